/*
 * emsd.pool._probe: the index lookup loop of emsd/pool/index.py and the passes of
 * emsd/pool/store.py's eviction scan and page stealing, in C.
 *
 * find(table, w0, rest, words, tags, ns, shift, out, prefix)
 *
 * For each key i (words[i] = 4 little-endian uint64, tags[i] = uint8):
 *   nstag = ns << 8 | tag;  h = (sum_j words[i][j] * MUL[j]) ^ nstag;  h *= FINAL
 *   slot = h >> shift; walk the table forward until an EMPTY slot (0):
 *   an id >= 2 whose w0 equals words[i][0] and whose 28-byte rest row equals
 *   (words[i][1..3] as uint32 halves, nstag) is the key's entry.
 *   out[i] = that id, or 0 (EMPTY) when absent.
 * With prefix != 0 the walk stops at the first absent key; later keys read 0.
 *
 * place(table, w0, rest, ids, shift, limit) -> tombstones reused, or -1
 *
 * Puts each entry id (its key already in w0/rest) in the first EMPTY (0) or
 * TOMB (1) slot from its home slot, in order. Returns how many TOMB slots it
 * took, or -1 if a walk would reach slot ``limit`` (the table's reserved
 * EMPTY tail): the caller rebuilds the table then (ids placed so far stay).
 *
 * slots_of(table, w0, rest, ids, shift, out)
 *
 * out[i] = the table slot holding entry ids[i] (int64), or -1 if the walk
 * from its home slot meets an EMPTY slot first (not in the table).
 *
 * eligible(state, pins, offset, page_owner, units_per_page, cls, out) -> count
 *
 * The eviction scan's filter (store._scan): writes to out, ascending, the ids
 * of the entries that are READY (2), unpinned and on a page of class cls
 * (page_owner[offset // units_per_page] == cls), over the first out.size ids;
 * returns how many.
 *
 * page_ages(state, pins, offset, last_used, units_per_page, recent, blocked)
 *
 * Page stealing's pass over the entries (store._steal_page): for every live
 * entry (state PENDING 1 or READY 2) among the first state.size ids, on page
 * p = offset // units_per_page: recent[p] = max(recent[p], last_used) (int64,
 * the caller fills it with -1) and blocked[p] = 1 if the entry is PENDING or
 * pinned (uint8, the caller fills it with 0). Entries past the last page are
 * skipped.
 *
 * on_page(state, offset, units_per_page, page, out) -> count
 *
 * Writes to out, ascending, the ids of the live entries on page ``page``
 * (over the first out.size ids); returns how many.
 *
 * The hash is the one index.hash_keys computes with numpy (uint64 arithmetic
 * wraps in both). Every id and slot is bounds-checked: a corrupt table reads
 * as a miss, never as an out-of-bounds access. Same results as the numpy
 * path, which stays as the fallback when this extension is not built.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

static const uint64_t MUL[4] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL,
                                0x94D049BB133111EBULL, 0xD6E8FEB86659FD93ULL};
static const uint64_t FINAL = 0xFF51AFD7ED558CCDULL;
#define REST_COLS 7

static int get_buf(PyObject *obj, Py_buffer *view, Py_ssize_t itemsize, int writable, const char *name) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0)
        return -1;
    if (view->itemsize != itemsize) {
        PyErr_Format(PyExc_TypeError, "%s: expected items of %zd bytes, got %zd", name, itemsize,
                     view->itemsize);
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* get_buf for obj[0..n-1], those from index ``writable`` on writable; on failure the ones
 * already taken are released. Returns 0, or -1 with the exception set. */
static int get_bufs(PyObject **obj, Py_buffer *buf, int n, const Py_ssize_t *itemsize, const char **name,
                    int writable) {
    for (int i = 0; i < n; i++)
        if (get_buf(obj[i], &buf[i], itemsize[i], i >= writable, name[i]) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&buf[i]);
            return -1;
        }
    return 0;
}

static void release_bufs(Py_buffer *buf, int n) {
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&buf[i]);
}

enum { TABLE, W0, REST, WORDS, TAGS, OUT, NBUF };

static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *obj[NBUF];
    unsigned long long ns, shift;
    int prefix;
    if (!PyArg_ParseTuple(args, "OOOOOKKOp", &obj[TABLE], &obj[W0], &obj[REST], &obj[WORDS], &obj[TAGS],
                          &ns, &shift, &obj[OUT], &prefix))
        return NULL;
    static const Py_ssize_t itemsize[NBUF] = {4, 8, 4, 8, 1, 4};
    static const char *name[NBUF] = {"table", "w0", "rest", "words", "tags", "out"};
    Py_buffer buf[NBUF];
    int got = 0;
    PyObject *result = NULL;
    for (; got < NBUF; got++)
        if (get_buf(obj[got], &buf[got], itemsize[got], got == OUT, name[got]) < 0)
            goto done;

    Py_ssize_t n = buf[TAGS].len;
    Py_ssize_t n_slots = buf[TABLE].len / 4, n_entries = buf[W0].len / 8;
    if (buf[WORDS].len != n * 32 || buf[OUT].len != n * 4 || buf[REST].len / (4 * REST_COLS) < n_entries ||
        shift < 1 || shift > 63) {
        PyErr_SetString(PyExc_ValueError, "find: array sizes do not match");
        goto done;
    }
    const uint32_t *t = buf[TABLE].buf, *r = buf[REST].buf;
    const uint64_t *e0 = buf[W0].buf, *kw = buf[WORDS].buf;
    const uint8_t *tg = buf[TAGS].buf;
    uint32_t *o = buf[OUT].buf;
    Py_ssize_t i = 0;
    for (; i < n; i++) {
        const uint64_t *k = kw + 4 * i;
        uint32_t nstag = (uint32_t)(ns << 8) | tg[i];
        uint64_t h = k[0] * MUL[0] + k[1] * MUL[1] + k[2] * MUL[2] + k[3] * MUL[3];
        h = (h ^ nstag) * FINAL;
        uint32_t krec[REST_COLS];
        memcpy(krec, k + 1, 24); /* w1..w3 as uint32 halves, little-endian like numpy's view */
        krec[6] = nstag;
        uint32_t hit = 0;
        for (Py_ssize_t s = (Py_ssize_t)(h >> shift); s < n_slots; s++) {
            uint32_t id = t[s];
            if (id == 0)
                break;
            if (id < 2 || (Py_ssize_t)id >= n_entries)
                continue;
            if (e0[id] == k[0] && memcmp(r + (size_t)id * REST_COLS, krec, sizeof krec) == 0) {
                hit = id;
                break;
            }
        }
        o[i] = hit;
        if (!hit && prefix) {
            i++;
            break;
        }
    }
    for (; i < n; i++)
        o[i] = 0;
    Py_INCREF(Py_None);
    result = Py_None;
done:
    while (got-- > 0)
        PyBuffer_Release(&buf[got]);
    return result;
}

/* The home-slot hash of entry id, from its stored key (w0 and the rest row). */
static uint64_t entry_hash(const uint64_t *e0, const uint32_t *r, uint32_t id) {
    const uint32_t *row = r + (size_t)id * REST_COLS;
    uint64_t w[3];
    memcpy(w, row, 24); /* w1..w3 from their uint32 halves, little-endian like numpy's view */
    uint64_t h = e0[id] * MUL[0] + w[0] * MUL[1] + w[1] * MUL[2] + w[2] * MUL[3];
    return (h ^ row[6]) * FINAL;
}

enum { E_TABLE, E_W0, E_REST, E_IDS, E_OUT, E_NBUF };

/* Buffers of place/slots_of: table (u32, writable for place), w0 (u64), rest (u32 rows), ids (u32),
 * and for slots_of out (i64). Checks sizes and that every id is an entry; 0 or -1 with an error. */
static int entry_bufs(PyObject **obj, Py_buffer *buf, int nbuf, int table_writable, unsigned long long shift,
                      const char *what) {
    static const Py_ssize_t itemsize[E_NBUF] = {4, 8, 4, 4, 8};
    static const char *name[E_NBUF] = {"table", "w0", "rest", "ids", "out"};
    int got = 0;
    for (; got < nbuf; got++)
        if (get_buf(obj[got], &buf[got], itemsize[got], got == E_OUT || (got == E_TABLE && table_writable),
                    name[got]) < 0)
            goto fail;
    Py_ssize_t n = buf[E_IDS].len / 4, n_entries = buf[E_W0].len / 8;
    if (buf[E_REST].len / (4 * REST_COLS) < n_entries || shift < 1 || shift > 63 ||
        (nbuf > E_OUT && buf[E_OUT].len != n * 8)) {
        PyErr_Format(PyExc_ValueError, "%s: array sizes do not match", what);
        goto fail;
    }
    const uint32_t *ids = buf[E_IDS].buf;
    for (Py_ssize_t i = 0; i < n; i++)
        if (ids[i] < 2 || (Py_ssize_t)ids[i] >= n_entries) {
            PyErr_Format(PyExc_ValueError, "%s: %u is not an entry id", what, ids[i]);
            goto fail;
        }
    return 0;
fail:
    while (got-- > 0)
        PyBuffer_Release(&buf[got]);
    return -1;
}

static PyObject *place(PyObject *self, PyObject *args) {
    PyObject *obj[E_NBUF - 1];
    unsigned long long shift;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "OOOOKn", &obj[E_TABLE], &obj[E_W0], &obj[E_REST], &obj[E_IDS], &shift, &limit))
        return NULL;
    Py_buffer buf[E_NBUF - 1];
    if (entry_bufs(obj, buf, E_NBUF - 1, 1, shift, "place") < 0)
        return NULL;
    uint32_t *t = buf[E_TABLE].buf;
    const uint32_t *r = buf[E_REST].buf, *ids = buf[E_IDS].buf;
    const uint64_t *e0 = buf[E_W0].buf;
    Py_ssize_t n = buf[E_IDS].len / 4, n_slots = buf[E_TABLE].len / 4;
    if (limit > n_slots)
        limit = n_slots;
    long long tombs = 0;
    for (Py_ssize_t i = 0; i < n && tombs >= 0; i++) {
        Py_ssize_t s = (Py_ssize_t)(entry_hash(e0, r, ids[i]) >> shift);
        while (s < limit && t[s] > 1)
            s++;
        if (s >= limit) {
            tombs = -1; /* crowded: the caller rebuilds the table */
            break;
        }
        tombs += t[s]; /* EMPTY is 0, TOMB is 1 */
        t[s] = ids[i];
    }
    for (int k = 0; k < E_NBUF - 1; k++)
        PyBuffer_Release(&buf[k]);
    return PyLong_FromLongLong(tombs);
}

static PyObject *slots_of(PyObject *self, PyObject *args) {
    PyObject *obj[E_NBUF];
    unsigned long long shift;
    if (!PyArg_ParseTuple(args, "OOOOKO", &obj[E_TABLE], &obj[E_W0], &obj[E_REST], &obj[E_IDS], &shift,
                          &obj[E_OUT]))
        return NULL;
    Py_buffer buf[E_NBUF];
    if (entry_bufs(obj, buf, E_NBUF, 0, shift, "slots_of") < 0)
        return NULL;
    const uint32_t *t = buf[E_TABLE].buf, *r = buf[E_REST].buf, *ids = buf[E_IDS].buf;
    const uint64_t *e0 = buf[E_W0].buf;
    int64_t *o = buf[E_OUT].buf;
    Py_ssize_t n = buf[E_IDS].len / 4, n_slots = buf[E_TABLE].len / 4;
    for (Py_ssize_t i = 0; i < n; i++) {
        o[i] = -1;
        for (Py_ssize_t s = (Py_ssize_t)(entry_hash(e0, r, ids[i]) >> shift); s < n_slots && t[s]; s++)
            if (t[s] == ids[i]) {
                o[i] = s;
                break;
            }
    }
    for (int k = 0; k < E_NBUF; k++)
        PyBuffer_Release(&buf[k]);
    Py_RETURN_NONE;
}

static PyObject *eligible(PyObject *self, PyObject *args) {
    PyObject *obj[5];
    unsigned long long upp;
    int cls;
    if (!PyArg_ParseTuple(args, "OOOOKiO", &obj[0], &obj[1], &obj[2], &obj[3], &upp, &cls, &obj[4]))
        return NULL;
    static const Py_ssize_t itemsize[5] = {1, 4, 4, 4, 4};
    static const char *name[5] = {"state", "pins", "offset", "page_owner", "out"};
    Py_buffer buf[5];
    PyObject *result = NULL;
    if (get_bufs(obj, buf, 5, itemsize, name, 4) < 0)
        return NULL;
    Py_ssize_t n = buf[4].len / 4, pages = buf[3].len / 4;
    if (buf[0].len < n || buf[1].len / 4 < n || buf[2].len / 4 < n || upp < 1) {
        PyErr_SetString(PyExc_ValueError, "eligible: array sizes do not match");
        goto done;
    }
    const uint8_t *state = buf[0].buf;
    const uint32_t *pins = buf[1].buf, *offset = buf[2].buf;
    const int32_t *owner = buf[3].buf;
    uint32_t *out = buf[4].buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t id = 0; id < n; id++) {
        if (state[id] != 2 || pins[id] != 0)
            continue;
        unsigned long long page = offset[id] / upp;
        if (page < (unsigned long long)pages && owner[page] == cls)
            out[count++] = (uint32_t)id;
    }
    result = PyLong_FromSsize_t(count);
done:
    release_bufs(buf, 5);
    return result;
}

static PyObject *page_ages(PyObject *self, PyObject *args) {
    PyObject *obj[6];
    unsigned long long upp;
    if (!PyArg_ParseTuple(args, "OOOOKOO", &obj[0], &obj[1], &obj[2], &obj[3], &upp, &obj[4], &obj[5]))
        return NULL;
    static const Py_ssize_t itemsize[6] = {1, 4, 4, 4, 8, 1};
    static const char *name[6] = {"state", "pins", "offset", "last_used", "recent", "blocked"};
    Py_buffer buf[6];
    PyObject *result = NULL;
    if (get_bufs(obj, buf, 6, itemsize, name, 4) < 0)
        return NULL;
    Py_ssize_t n = buf[0].len, pages = buf[4].len / 8;
    if (buf[1].len / 4 < n || buf[2].len / 4 < n || buf[3].len / 4 < n || buf[5].len != pages || upp < 1) {
        PyErr_SetString(PyExc_ValueError, "page_ages: array sizes do not match");
        goto done;
    }
    const uint8_t *state = buf[0].buf;
    const uint32_t *pins = buf[1].buf, *offset = buf[2].buf, *last = buf[3].buf;
    int64_t *recent = buf[4].buf;
    uint8_t *blocked = buf[5].buf;
    for (Py_ssize_t id = 0; id < n; id++) {
        if (state[id] != 1 && state[id] != 2)
            continue;
        unsigned long long page = offset[id] / upp;
        if (page >= (unsigned long long)pages)
            continue;
        if ((int64_t)last[id] > recent[page])
            recent[page] = last[id];
        if (state[id] == 1 || pins[id] != 0)
            blocked[page] = 1;
    }
    result = Py_None;
    Py_INCREF(result);
done:
    release_bufs(buf, 6);
    return result;
}

static PyObject *on_page(PyObject *self, PyObject *args) {
    PyObject *obj[3];
    unsigned long long upp, want;
    if (!PyArg_ParseTuple(args, "OOKKO", &obj[0], &obj[1], &upp, &want, &obj[2]))
        return NULL;
    static const Py_ssize_t itemsize[3] = {1, 4, 4};
    static const char *name[3] = {"state", "offset", "out"};
    Py_buffer buf[3];
    PyObject *result = NULL;
    if (get_bufs(obj, buf, 3, itemsize, name, 2) < 0)
        return NULL;
    Py_ssize_t n = buf[2].len / 4;
    if (buf[0].len < n || buf[1].len / 4 < n || upp < 1) {
        PyErr_SetString(PyExc_ValueError, "on_page: array sizes do not match");
        goto done;
    }
    const uint8_t *state = buf[0].buf;
    const uint32_t *offset = buf[1].buf;
    uint32_t *out = buf[2].buf;
    Py_ssize_t count = 0;
    for (Py_ssize_t id = 0; id < n; id++)
        if ((state[id] == 1 || state[id] == 2) && offset[id] / upp == want)
            out[count++] = (uint32_t)id;
    result = PyLong_FromSsize_t(count);
done:
    release_bufs(buf, 3);
    return result;
}

static PyMethodDef methods[] = {
    {"eligible", eligible, METH_VARARGS, "eligible(state, pins, offset, page_owner, units_per_page, cls, out)"},
    {"find", find, METH_VARARGS, "find(table, w0, rest, words, tags, ns, shift, out, prefix)"},
    {"place", place, METH_VARARGS, "place(table, w0, rest, ids, shift, limit) -> tombstones reused or -1"},
    {"slots_of", slots_of, METH_VARARGS, "slots_of(table, w0, rest, ids, shift, out)"},
    {"page_ages", page_ages, METH_VARARGS,
     "page_ages(state, pins, offset, last_used, units_per_page, recent, blocked)"},
    {"on_page", on_page, METH_VARARGS, "on_page(state, offset, units_per_page, page, out) -> count"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe",
                                    "The index lookup loop of emsd.pool.index, in C.", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
