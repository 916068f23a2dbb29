/*
 * emsd.pool._shared_index: the shared index's table (emsd/pool/shared_index.py), in C.
 *
 * The table is a byte buffer: a 64-byte header, then (1 << bits) + WINDOW slots of
 * 64 bytes. Header: magic u64 (MAGIC), bits u32, window u32, the rest reserved.
 * Slot: seq u64, key words w[4] u64, tag u32 (~(ns << 8 | tag), so that 0, a new file's
 * bytes, is a free slot: no key has nstag 0xFFFFFFFF), length u32, offset u64 (bytes
 * into the pool), 8 bytes unused.
 *
 * Only the daemon writes (publish, retract, retract_ns); clients read (find, check).
 * Every slot is a sequence lock: the writer makes seq odd, writes the fields, makes seq
 * even again, so a reader that saw the same even seq before and after reading knows
 * what it read is whole. A key lives in the first free slot of its window of WINDOW
 * slots from its home slot (the top ``bits`` bits of the index's hash,
 * emsd.pool.index.hash_keys); a key whose window is full is not published (the
 * caller counts it: such a key is simply not found here, and the client asks the
 * daemon). No wrap: the table has WINDOW slots past the home range.
 *
 * publish(table, w0, rest, ids, offset, length, unit) -> entries published
 *     Entries ``ids`` of an emsd.pool.index.BlockIndex (its w0, rest, offset and length
 *     arrays), each at byte offset offset[id] * unit.
 * retract(table, w0, rest, ids) -> entries retracted (ones not published are skipped)
 * retract_ns(table, ns) -> slots of namespace ns retracted (a scan of the table)
 * find(table, words, nstag, limit, offsets, lengths, slots, seqs) -> leading keys found
 *     For each key in order until the first one not found (or found mid-write, or with
 *     offset + length past ``limit``): its offset, length, slot and seq.
 * check(table, slots, seqs) -> bool
 *     After the caller copied the blocks find gave: whether every slot still has the seq
 *     find saw, that is, no block was retracted (and its chunk possibly reused) since.
 * find_one(table, w0, w1, w2, w3, nstag, limit) -> (offset, length, slot, seq) or None
 * check_one(table, slot, seq) -> bool
 *     find and check of one key (a one-block load), with scalars instead of arrays.
 *
 * Every slot index is bounds-checked against the buffer: a table too small for its
 * header reads as empty, never as an out-of-bounds access.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAGIC 0x3130584449534d45ULL /* "EMSIDX01" little-endian */
#define HEADER 64
#define SLOT 64
#define WINDOW 8
#define EMPTY_NSTAG 0xFFFFFFFFu /* no key has it: a slot written with it is free (tag 0) */
#define REST_COLS 7 /* emsd.pool.index: w1..w3 as uint32 halves, then nstag */

static const uint64_t MUL[4] = {0x9E3779B97F4A7C15ULL, 0xBF58476D1CE4E5B9ULL,
                                0x94D049BB133111EBULL, 0xD6E8FEB86659FD93ULL};
static const uint64_t FINAL = 0xFF51AFD7ED558CCDULL;

typedef struct {
    uint64_t seq;
    uint64_t w[4];
    uint32_t tag; /* ~nstag; 0: free */
    uint32_t length;
    uint64_t offset;
    uint64_t unused;
} slot_t;

typedef struct {
    slot_t *slots;
    Py_ssize_t n; /* slots in all: home range plus tail */
    unsigned bits;
} table_t;

/* The table in ``buf``, or n = 0 when its header is not a table's. */
static table_t table_of(Py_buffer *buf) {
    table_t t = {NULL, 0, 0};
    if (buf->len < HEADER)
        return t;
    const uint64_t *h = buf->buf;
    unsigned bits = ((const uint32_t *)buf->buf)[2];
    if (h[0] != MAGIC || bits < 1 || bits > 40)
        return t;
    Py_ssize_t want = ((Py_ssize_t)1 << bits) + WINDOW;
    if ((buf->len - HEADER) / SLOT < want)
        return t;
    t.slots = (slot_t *)((char *)buf->buf + HEADER);
    t.n = want;
    t.bits = bits;
    return t;
}

static Py_ssize_t home(const table_t *t, const uint64_t *k, uint32_t nstag) {
    uint64_t h = k[0] * MUL[0] + k[1] * MUL[1] + k[2] * MUL[2] + k[3] * MUL[3];
    h = (h ^ nstag) * FINAL;
    return (Py_ssize_t)(h >> (64 - t->bits));
}

static int same_key(const slot_t *s, const uint64_t *k, uint32_t nstag) {
    return __atomic_load_n(&s->tag, __ATOMIC_RELAXED) == ~nstag &&
           __atomic_load_n(&s->w[0], __ATOMIC_RELAXED) == k[0] &&
           __atomic_load_n(&s->w[1], __ATOMIC_RELAXED) == k[1] &&
           __atomic_load_n(&s->w[2], __ATOMIC_RELAXED) == k[2] &&
           __atomic_load_n(&s->w[3], __ATOMIC_RELAXED) == k[3];
}

/* The writer's side of a slot's sequence lock: odd while the fields change. */
static void write_slot(slot_t *s, const uint64_t *k, uint32_t nstag, uint32_t length, uint64_t offset) {
    uint64_t seq = s->seq;
    __atomic_store_n(&s->seq, seq + 1, __ATOMIC_RELAXED);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int j = 0; j < 4; j++)
        __atomic_store_n(&s->w[j], k[j], __ATOMIC_RELAXED);
    __atomic_store_n(&s->length, length, __ATOMIC_RELAXED);
    __atomic_store_n(&s->offset, offset, __ATOMIC_RELAXED);
    __atomic_store_n(&s->tag, ~nstag, __ATOMIC_RELAXED);
    __atomic_store_n(&s->seq, seq + 2, __ATOMIC_RELEASE);
}

static const uint64_t ZERO_KEY[4] = {0, 0, 0, 0};

static int get(PyObject *obj, Py_buffer *view, int writable) {
    return PyObject_GetBuffer(obj, view, PyBUF_C_CONTIGUOUS | (writable ? PyBUF_WRITABLE : 0));
}

/* Buffers obj[0..n-1] (obj[0] the table); ``writable`` says which, one bit each. */
static int get_all(PyObject **obj, Py_buffer *buf, int n, unsigned writable) {
    for (int i = 0; i < n; i++) {
        if (get(obj[i], &buf[i], (writable >> i) & 1) < 0) {
            while (i-- > 0)
                PyBuffer_Release(&buf[i]);
            return -1;
        }
    }
    return 0;
}

static void release_all(Py_buffer *buf, int n) {
    for (int i = 0; i < n; i++)
        PyBuffer_Release(&buf[i]);
}

/* The key of index entry ``id``: its words (w0, then w1..w3 from the uint32 halves of its
 * rest row, little-endian like numpy's view) and its nstag (the row's last column). */
static uint32_t entry_key(const uint64_t *w0, const uint32_t *rest, uint32_t id, uint64_t k[4]) {
    const uint32_t *row = rest + (size_t)id * REST_COLS;
    k[0] = w0[id];
    memcpy(k + 1, row, 24);
    return row[6];
}

/* Buffers of publish/retract: table (writable), w0 (u64), rest (u32 rows), ids (u32), then for
 * publish offset and length (u32 per entry). Checks every id against the entry arrays. */
static int entry_bufs(PyObject **obj, Py_buffer *buf, int n) {
    if (get_all(obj, buf, n, 1) < 0)
        return -1;
    Py_ssize_t entries = buf[1].len / 8;
    int ok = buf[2].len / (4 * REST_COLS) >= entries;
    for (int i = 4; ok && i < n; i++)
        ok = buf[i].len / 4 >= entries;
    const uint32_t *ids = buf[3].buf;
    for (Py_ssize_t i = 0; ok && i < buf[3].len / 4; i++)
        ok = ids[i] < entries;
    if (!ok) {
        PyErr_SetString(PyExc_ValueError, "shared index: entry arrays and ids do not match");
        release_all(buf, n);
        return -1;
    }
    return 0;
}

/* The slot of key k's window that holds it, or -1; unless free_at is NULL, *free_at: the
 * window's first free slot, or -1. The writer's view (only it writes, so no seq is needed). */
static Py_ssize_t slot_of(const table_t *t, const uint64_t *k, uint32_t nstag, Py_ssize_t *free_at) {
    Py_ssize_t s0 = home(t, k, nstag);
    if (free_at)
        *free_at = -1;
    for (Py_ssize_t s = s0; s < s0 + WINDOW && s < t->n; s++) {
        const slot_t *sl = &t->slots[s];
        if (sl->tag == 0) {
            if (free_at && *free_at < 0)
                *free_at = s;
        } else if (same_key(sl, k, nstag)) {
            return s;
        }
    }
    return -1;
}

static PyObject *publish(PyObject *self, PyObject *args) {
    PyObject *obj[6];
    unsigned long long unit;
    if (!PyArg_ParseTuple(args, "OOOOOOK", &obj[0], &obj[1], &obj[2], &obj[3], &obj[4], &obj[5], &unit))
        return NULL;
    Py_buffer buf[6];
    if (entry_bufs(obj, buf, 6) < 0)
        return NULL;
    table_t t = table_of(&buf[0]);
    const uint64_t *w0 = buf[1].buf;
    const uint32_t *rest = buf[2].buf, *ids = buf[3].buf, *offset = buf[4].buf, *length = buf[5].buf;
    Py_ssize_t n = buf[3].len / 4, done = 0;
    for (Py_ssize_t i = 0; t.n && i < n; i++) {
        uint64_t k[4];
        uint32_t nstag = entry_key(w0, rest, ids[i], k);
        Py_ssize_t free_at, at = slot_of(&t, k, nstag, &free_at);
        if (at < 0) /* else published already: written again with these fields */
            at = free_at;
        if (at >= 0) {
            write_slot(&t.slots[at], k, nstag, length[ids[i]], (uint64_t)offset[ids[i]] * unit);
            done++;
        }
    }
    release_all(buf, 6);
    return PyLong_FromSsize_t(done);
}

static PyObject *retract(PyObject *self, PyObject *args) {
    PyObject *obj[4];
    if (!PyArg_ParseTuple(args, "OOOO", &obj[0], &obj[1], &obj[2], &obj[3]))
        return NULL;
    Py_buffer buf[4];
    if (entry_bufs(obj, buf, 4) < 0)
        return NULL;
    table_t t = table_of(&buf[0]);
    const uint64_t *w0 = buf[1].buf;
    const uint32_t *rest = buf[2].buf, *ids = buf[3].buf;
    Py_ssize_t n = buf[3].len / 4, gone = 0;
    for (Py_ssize_t i = 0; t.n && i < n; i++) {
        uint64_t k[4];
        uint32_t nstag = entry_key(w0, rest, ids[i], k);
        Py_ssize_t at = slot_of(&t, k, nstag, NULL);
        if (at >= 0) {
            write_slot(&t.slots[at], ZERO_KEY, EMPTY_NSTAG, 0, 0);
            gone++;
        }
    }
    release_all(buf, 4);
    return PyLong_FromSsize_t(gone);
}

static PyObject *retract_ns(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long ns;
    if (!PyArg_ParseTuple(args, "OK", &obj, &ns))
        return NULL;
    Py_buffer buf;
    if (get(obj, &buf, 1) < 0)
        return NULL;
    table_t t = table_of(&buf);
    Py_ssize_t gone = 0;
    for (Py_ssize_t s = 0; s < t.n; s++) {
        uint32_t tag = t.slots[s].tag;
        if (tag != 0 && (~tag >> 8) == ns) {
            write_slot(&t.slots[s], ZERO_KEY, EMPTY_NSTAG, 0, 0);
            gone++;
        }
    }
    PyBuffer_Release(&buf);
    return PyLong_FromSsize_t(gone);
}

typedef struct {
    uint64_t offset;
    uint32_t length;
    uint32_t slot;
    uint64_t seq;
} found_t;

/* Look key k (nstag) up as a reader: whether it is published whole (not mid-write) with its
 * block within ``limit`` bytes of the pool, and if so where (*f). */
static int find_key(const table_t *t, const uint64_t *k, uint32_t nstag, uint64_t limit, found_t *f) {
    Py_ssize_t s0 = home(t, k, nstag);
    for (Py_ssize_t s = s0; s < s0 + WINDOW && s < t->n; s++) {
        slot_t *sl = &t->slots[s];
        uint64_t seq = __atomic_load_n(&sl->seq, __ATOMIC_ACQUIRE);
        if (seq & 1 || !same_key(sl, k, nstag))
            continue;
        uint64_t off = __atomic_load_n(&sl->offset, __ATOMIC_RELAXED);
        uint32_t len = __atomic_load_n(&sl->length, __ATOMIC_RELAXED);
        __atomic_thread_fence(__ATOMIC_ACQUIRE);
        if (__atomic_load_n(&sl->seq, __ATOMIC_RELAXED) != seq)
            continue; /* changed while read: as if absent (the daemon answers) */
        if (len == 0 || off > limit || len > limit - off)
            return 0;
        f->offset = off;
        f->length = len;
        f->slot = (uint32_t)s;
        f->seq = seq;
        return 1;
    }
    return 0;
}

static PyObject *find(PyObject *self, PyObject *args) {
    PyObject *obj[7];
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "OOOKOOOO", &obj[0], &obj[1], &obj[2], &limit, &obj[3], &obj[4], &obj[5],
                          &obj[6]))
        return NULL;
    Py_buffer buf[7];
    if (get_all(obj, buf, 7, 0x78) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = buf[2].len / 4;
    if (buf[1].len != n * 32 || buf[3].len != n * 8 || buf[4].len != n * 8 || buf[5].len != n * 4 ||
        buf[6].len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "find: array sizes do not match");
        goto done;
    }
    table_t t = table_of(&buf[0]);
    const uint64_t *kw = buf[1].buf;
    const uint32_t *nst = buf[2].buf;
    uint64_t *offsets = buf[3].buf, *lengths = buf[4].buf, *seqs = buf[6].buf;
    uint32_t *slots = buf[5].buf;
    Py_ssize_t count = 0;
    for (; t.n && count < n; count++) {
        found_t f;
        if (!find_key(&t, kw + 4 * count, nst[count], limit, &f))
            break;
        offsets[count] = f.offset;
        lengths[count] = f.length;
        slots[count] = f.slot;
        seqs[count] = f.seq;
    }
    result = PyLong_FromSsize_t(count);
done:
    release_all(buf, 7);
    return result;
}

static PyObject *check(PyObject *self, PyObject *args) {
    PyObject *obj[3];
    if (!PyArg_ParseTuple(args, "OOO", &obj[0], &obj[1], &obj[2]))
        return NULL;
    Py_buffer buf[3];
    if (get_all(obj, buf, 3, 0) < 0)
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = buf[1].len / 4;
    if (buf[2].len != n * 8) {
        PyErr_SetString(PyExc_ValueError, "check: array sizes do not match");
        goto done;
    }
    table_t t = table_of(&buf[0]);
    const uint32_t *slots = buf[1].buf;
    const uint64_t *seqs = buf[2].buf;
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy's loads come before the loads below */
    int ok = t.n > 0 || n == 0;
    for (Py_ssize_t i = 0; ok && i < n; i++)
        ok = (Py_ssize_t)slots[i] < t.n &&
             __atomic_load_n(&t.slots[slots[i]].seq, __ATOMIC_RELAXED) == seqs[i];
    result = PyBool_FromLong(ok);
done:
    release_all(buf, 3);
    return result;
}

static PyObject *find_one(PyObject *self, PyObject *args) {
    PyObject *obj;
    uint64_t k[4];
    unsigned int nstag;
    unsigned long long limit;
    if (!PyArg_ParseTuple(args, "OKKKKIK", &obj, &k[0], &k[1], &k[2], &k[3], &nstag, &limit))
        return NULL;
    Py_buffer buf;
    if (get(obj, &buf, 0) < 0)
        return NULL;
    table_t t = table_of(&buf);
    found_t f;
    int hit = t.n && find_key(&t, k, nstag, limit, &f);
    PyBuffer_Release(&buf);
    if (!hit)
        Py_RETURN_NONE;
    return Py_BuildValue("(KkkK)", (unsigned long long)f.offset, (unsigned long)f.length,
                         (unsigned long)f.slot, (unsigned long long)f.seq);
}

static PyObject *check_one(PyObject *self, PyObject *args) {
    PyObject *obj;
    unsigned long long slot, seq;
    if (!PyArg_ParseTuple(args, "OKK", &obj, &slot, &seq))
        return NULL;
    Py_buffer buf;
    if (get(obj, &buf, 0) < 0)
        return NULL;
    table_t t = table_of(&buf);
    __atomic_thread_fence(__ATOMIC_ACQUIRE); /* the copy's loads come before the load below */
    int ok = slot < (unsigned long long)t.n && __atomic_load_n(&t.slots[slot].seq, __ATOMIC_RELAXED) == seq;
    PyBuffer_Release(&buf);
    return PyBool_FromLong(ok);
}

static PyMethodDef methods[] = {
    {"publish", publish, METH_VARARGS, "publish(table, w0, rest, ids, offset, length, unit) -> published"},
    {"retract", retract, METH_VARARGS, "retract(table, w0, rest, ids) -> retracted"},
    {"retract_ns", retract_ns, METH_VARARGS, "retract_ns(table, ns) -> slots retracted"},
    {"find", find, METH_VARARGS, "find(table, words, nstag, limit, offsets, lengths, slots, seqs) -> count"},
    {"check", check, METH_VARARGS, "check(table, slots, seqs) -> whether no slot changed"},
    {"find_one", find_one, METH_VARARGS,
     "find_one(table, w0, w1, w2, w3, nstag, limit) -> (offset, length, slot, seq) or None"},
    {"check_one", check_one, METH_VARARGS, "check_one(table, slot, seq) -> whether the slot did not change"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_shared_index",
                                    "The shared index's table (emsd.pool.shared_index), in C.", -1, methods};

PyMODINIT_FUNC PyInit__shared_index(void) { return PyModule_Create(&module); }
