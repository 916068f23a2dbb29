/*
 * emsd.pool._probe: the index lookup loop of emsd/pool/index.py, in C.
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

static PyMethodDef methods[] = {
    {"find", find, METH_VARARGS, "find(table, w0, rest, words, tags, ns, shift, out, prefix)"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_probe",
                                    "The index lookup loop of emsd.pool.index, in C.", -1, methods};

PyMODINIT_FUNC PyInit__probe(void) { return PyModule_Create(&module); }
