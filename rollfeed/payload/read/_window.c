/* The compiled window read: the common case of rollfeed.payload.read_fields in one pass.
 *
 * Python side: rollfeed/payload/read/compiled_read.py (what it hands over, and when it is used).
 *
 * plan(segments, specs) takes the records and, per field, its spec and window; it returns a Plan
 * naming the files to open, or None when the read is not the common case. Plan.read(entries,
 * parallel_min, max_output) takes those files as the root's descriptor cache holds them open
 * (.fd, and .columns: size, format version, file id, file header size), reads every field over
 * its window and returns, per field with records, (name, values, coverage, dtype code, row
 * shape), or None (also when a field's values would take more than max_output bytes):
 * the caller then runs the planned NumPy reader, which handles every case and raises the typed
 * error naming the file, field, offset and position. This file never raises for bad data: it
 * declines. Every check the planned reader makes is made here too (records plausible and not
 * overlapping, byte ranges inside their files before any allocation, file ids, each region header
 * compared with the one the record implies, the CSR block offsets chained and inside the
 * region); a record or file this code does not take as is (an older format version, a
 * placeholder-only field, integer ids of several widths) is declined, never guessed at.
 *
 * I/O: the ranges of all fields are sorted per file, and ranges that touch or lie at most 4 KiB
 * apart become one preadv (the bytes between land in a scratch buffer), without the GIL. A
 * ragged field reads each record's region header and the index blocks covering its rows, plus
 * all its values when the window reads every row of a region that the record spans whole; the
 * values of other records are read in a second pass, once their index says where they lie.
 *
 * Little-endian hosts only (the file format is little endian): the module refuses to import
 * elsewhere, and the NumPy reader runs instead.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>

#define MAX_EXTENT ((int64_t)1 << 62)    /* layout.MAX_EXTENT */
#define MAX_ROW_ELEMS ((int64_t)1 << 24) /* layout.MAX_ROW_ELEMS */
#define BLOCK_ROWS 128       /* layout.BLOCK_ROWS */
#define BLOCK_BYTES 65536    /* checksum.BLOCK_BYTES */
#define REGION_HEADER 64     /* layout.REGION_HEADER.size */
#define MAX_NDIM 4           /* layout.MAX_NDIM */
#define GAP 4096             /* stores/local.GAP */
#define N_DTYPES 11
#define CODE_INT32 5
#define CODE_FLOAT32 8
#define CODE_UINT24 10
#define MAX_IOV 512
#define FORMAT_VERSION 3     /* layout.VERSION: the only version read here */

static const char *DTYPE_NAMES[N_DTYPES] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32",
    "int64", "float16", "float32", "float64", "uint24"};
static const int64_t ITEMSIZE[N_DTYPES] = {1, 1, 2, 2, 4, 4, 8, 2, 4, 8, 3};

typedef struct {
    int64_t pos, rows, offset, first, file_id;
    int64_t lay_rows, lay_values, block;  /* ragged layout (0 for fixed) */
    int64_t dims[MAX_NDIM];
    int32_t ndim, dtype, cb, has_layout;
    int32_t file;      /* index into Plan.all_files */
    int32_t read;      /* its bytes are read: fixed, it meets the window; ragged, it has rows */
    int32_t whole;     /* ragged: index and values read in the first pass */
    int64_t hslot;     /* header: offset into the header buffer */
    int64_t islot;     /* ragged: its index blocks in the index buffer */
    int64_t vslot;     /* ragged, whole: its values in the values buffer */
    int64_t row_base;  /* ragged: its rows in counts / starts */
} Rec;

typedef struct {
    PyObject *name;  /* str */
    const char *key;
    Py_ssize_t key_len;
    int ragged, lead, allowed;
    int64_t width;   /* -1: any; else the widest a row of its records may be */
    int64_t widest;  /* ragged: the widest row of its records, label slot included */
    Py_buffer labels; /* lead: n int32 or int64 tokens for the label slots (.buf NULL: fill) */
    unsigned char fills[N_DTYPES][8];
    int64_t *lo, *hi;
    Py_ssize_t nranges;
    int64_t n;
    Rec *recs;
    Py_ssize_t nrecs, cap;
    Py_ssize_t first_live;  /* records sorted by position; live ones from here on */
} Field;

typedef struct {
    PyObject_HEAD
    Field *fields;
    Py_ssize_t nfields;
    PyObject *all_files;  /* list of str: every file a record of a wanted field names */
    PyObject *files;      /* list of str: the files to open */
    int32_t *lease_of;    /* all_files index -> files index, -1 when not opened */
} Plan;

typedef struct {
    int32_t file;
    int64_t off, len;
    char *dst;
} Range;

typedef struct {
    Range *r;
    Py_ssize_t n, cap;
} Ranges;

/* ---- small helpers ---------------------------------------------------------------------- */

static int push_range(Ranges *rs, int32_t file, int64_t off, int64_t len, char *dst) {
    if (len <= 0) return 0;
    if (rs->n == rs->cap) {
        Py_ssize_t cap = rs->cap ? 2 * rs->cap : 256;
        Range *r = realloc(rs->r, cap * sizeof(Range));
        if (!r) return -1;
        rs->r = r;
        rs->cap = cap;
    }
    rs->r[rs->n++] = (Range){file, off, len, dst};
    return 0;
}

static int by_file_offset(const void *a, const void *b) {
    const Range *x = a, *y = b;
    if (x->file != y->file) return x->file < y->file ? -1 : 1;
    if (x->off != y->off) return x->off < y->off ? -1 : 1;
    return 0;
}

/* Read every range; 0 when every byte arrived, -1 otherwise (an error, a short read). */
static int issue(Ranges *rs, const int *fds) {
    qsort(rs->r, rs->n, sizeof(Range), by_file_offset);
    char scratch[GAP];
    struct iovec iov[MAX_IOV];
    int ok = 0;
    Py_BEGIN_ALLOW_THREADS
    Py_ssize_t i = 0;
    while (i < rs->n && ok == 0) {
        Range *r = rs->r;
        int32_t f = r[i].file;
        int64_t start = r[i].off, at = r[i].off, want = 0;
        int cnt = 0;
        Py_ssize_t j = i;
        while (j < rs->n && r[j].file == f && cnt < MAX_IOV - 1) {
            int64_t gap = r[j].off - at;
            if (j > i && (gap < 0 || gap > GAP)) break;
            if (gap > 0) {
                iov[cnt++] = (struct iovec){scratch, (size_t)gap};
                want += gap;
            }
            iov[cnt++] = (struct iovec){r[j].dst, (size_t)r[j].len};
            want += r[j].len;
            at = r[j].off + r[j].len;
            j++;
        }
        ssize_t got = preadv(fds[f], iov, cnt, (off_t)start);
        if (got != (ssize_t)want) ok = -1;
        i = j;
    }
    Py_END_ALLOW_THREADS
    return ok;
}

static int64_t div_up(int64_t a, int64_t b) { return (a + b - 1) / b; }

static int64_t index_bytes(int64_t rows, int64_t cb, int64_t block) {
    return div_up(rows, block) * 8 + rows * cb;
}

static int64_t values_start(int64_t rows, int64_t cb, int64_t block) {
    return div_up(index_bytes(rows, cb, block), 4) * 4;
}

static uint64_t load_le(const unsigned char *p, int n) {
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* An exact int (not a bool, not a subclass) that fits int64, or -1 with *ok cleared. */
static int64_t exact_int(PyObject *o, int *ok) {
    if (o == NULL || !PyLong_CheckExact(o)) {
        *ok = 0;
        return -1;
    }
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
    if (overflow || (v == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        *ok = 0;
        return -1;
    }
    return (int64_t)v;
}

static int dtype_code(PyObject *o) {
    if (o == NULL || !PyUnicode_CheckExact(o)) return -1;
    const char *s = PyUnicode_AsUTF8(o);
    if (s == NULL) {
        PyErr_Clear();
        return -1;
    }
    for (int c = 0; c < N_DTYPES; c++)
        if (strcmp(s, DTYPE_NAMES[c]) == 0) return c;
    return -1;
}

/* The record attributes read, interned once at import (a lookup then hashes nothing). */
enum { K_FIELD, K_FILE, K_POS, K_ROWS, K_OFFSET, K_FIRST, K_FILE_ID, K_DTYPE, K_SHAPE, K_RAGGED,
       K_VALUES, K_COUNT_BYTES, K_BLOCK_ROWS, K_FD, K_COLUMNS, N_KEYS };
static const char *KEY_NAMES[N_KEYS] = {"field", "file", "pos", "rows", "offset", "first",
                                        "file_id", "dtype", "shape", "ragged", "values",
                                        "count_bytes", "block_rows", "fd", "columns"};
static PyObject *KEYS[N_KEYS];

static PyObject *get(PyObject *dict, int key) {
    return PyDict_GetItemWithError(dict, KEYS[key]); /* borrowed; NULL when missing */
}

/* ---- planning ----------------------------------------------------------------------------- */

static void plan_free(Plan *p) {
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Py_XDECREF(p->fields[i].name);
        if (p->fields[i].labels.buf != NULL) PyBuffer_Release(&p->fields[i].labels);
        free(p->fields[i].lo);
        free(p->fields[i].recs);
    }
    free(p->fields);
    free(p->lease_of);
    Py_XDECREF(p->all_files);
    Py_XDECREF(p->files);
    p->fields = NULL;
    p->lease_of = NULL;
    p->all_files = p->files = NULL;
    p->nfields = 0;
}

static void Plan_dealloc(Plan *p) {
    plan_free(p);
    Py_TYPE(p)->tp_free((PyObject *)p);
}

/* spec: (name, ragged, lead, allowed, fills, ranges, width, labels): labels None or n int32 or
 * int64 (C-contiguous, native). 0 taken, 1 declined, -1 error. */
static int parse_spec(PyObject *spec, Field *f) {
    PyObject *name, *fills, *ranges, *labels;
    int ragged, lead, allowed;
    long long width;
    if (!PyArg_ParseTuple(spec, "UpiiSOLO", &name, &ragged, &lead, &allowed, &fills, &ranges,
                          &width, &labels))
        return -1;
    if (PyBytes_GET_SIZE(fills) != N_DTYPES * 8) {
        PyErr_SetString(PyExc_ValueError, "fills: 8 bytes per dtype code");
        return -1;
    }
    Py_INCREF(name);
    f->name = name;
    f->key = PyUnicode_AsUTF8AndSize(name, &f->key_len);
    if (f->key == NULL) return -1;
    if (f->key_len > 255) return 1;
    f->ragged = ragged;
    f->lead = lead;
    f->allowed = allowed;
    f->width = width;
    memcpy(f->fills, PyBytes_AS_STRING(fills), N_DTYPES * 8);
    PyObject *seq = PySequence_Fast(ranges, "ranges: a sequence of (lo, hi)");
    if (seq == NULL) return -1;
    Py_ssize_t k = PySequence_Fast_GET_SIZE(seq);
    f->lo = malloc(2 * (k ? k : 1) * sizeof(int64_t));
    if (f->lo == NULL) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return -1;
    }
    f->hi = f->lo + k;
    f->nranges = k;
    int ok = 1;
    for (Py_ssize_t i = 0; i < k && ok; i++) {
        PyObject *pair = PySequence_Fast_GET_ITEM(seq, i);
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            ok = 0;
            break;
        }
        f->lo[i] = exact_int(PyTuple_GET_ITEM(pair, 0), &ok);
        f->hi[i] = exact_int(PyTuple_GET_ITEM(pair, 1), &ok);
        if (ok && (f->lo[i] < 0 || f->hi[i] < f->lo[i] || f->hi[i] >= MAX_EXTENT)) ok = 0;
        if (ok && __builtin_add_overflow(f->n, f->hi[i] - f->lo[i], &f->n)) ok = 0;
    }
    Py_DECREF(seq);
    if (ok && labels != Py_None) {
        if (PyObject_GetBuffer(labels, &f->labels, PyBUF_C_CONTIGUOUS) < 0)
            return -1;
        Py_ssize_t size = f->labels.itemsize;
        if (!lead || (size != 4 && size != 8) || f->labels.len != size * f->n) ok = 0;
    }
    return ok ? 0 : 1;
}

/* One record into its field's table. 0 taken, 1 declined, -1 error. */
static int take_record(Field *f, PyObject *d, PyObject *file_index, PyObject *all_files,
                       int32_t *file) {
    PyObject *fname = get(d, K_FILE);
    if (fname == NULL || !PyUnicode_CheckExact(fname)) return 1;
    PyObject *at = PyDict_GetItemWithError(file_index, fname);
    if (at == NULL) {
        if (PyErr_Occurred()) return -1;
        Py_ssize_t k = PyList_GET_SIZE(all_files);
        if (k >= INT32_MAX) return 1;
        PyObject *num = PyLong_FromSsize_t(k);
        if (num == NULL || PyDict_SetItem(file_index, fname, num) < 0 ||
            PyList_Append(all_files, fname) < 0) {
            Py_XDECREF(num);
            return -1;
        }
        Py_DECREF(num);
        *file = (int32_t)k;
    } else {
        *file = (int32_t)PyLong_AsSsize_t(at);
    }
    if (f->nrecs == f->cap) {
        Py_ssize_t cap = f->cap ? 2 * f->cap : 64;
        Rec *r = realloc(f->recs, cap * sizeof(Rec));
        if (r == NULL) {
            PyErr_NoMemory();
            return -1;
        }
        f->recs = r;
        f->cap = cap;
    }
    Rec *r = &f->recs[f->nrecs];
    memset(r, 0, sizeof(Rec));
    r->file = *file;
    int ok = 1;
    r->pos = exact_int(get(d, K_POS), &ok);
    r->rows = exact_int(get(d, K_ROWS), &ok);
    r->offset = exact_int(get(d, K_OFFSET), &ok);
    r->first = exact_int(get(d, K_FIRST), &ok);
    PyObject *fid = get(d, K_FILE_ID);
    if (fid == NULL) return 1;
    r->file_id = fid == Py_None ? 0 : exact_int(fid, &ok);
    if (!ok) return 1;
    if (fid != Py_None && r->file_id < 1) return 1;
    int64_t cols[4] = {r->pos, r->rows, r->offset, r->first};
    for (int i = 0; i < 4; i++)
        if (cols[i] < 0 || cols[i] >= MAX_EXTENT) return 1;
    r->dtype = dtype_code(get(d, K_DTYPE));
    if (r->dtype < 0 || !(f->allowed & (1 << r->dtype))) return 1;
    PyObject *shape = get(d, K_SHAPE);
    if (shape == NULL || !PyTuple_CheckExact(shape)) return 1;
    Py_ssize_t ndim = PyTuple_GET_SIZE(shape);
    if (ndim > MAX_NDIM || (f->ragged && ndim)) return 1;
    r->ndim = (int32_t)ndim;
    int64_t elems = 1;
    for (Py_ssize_t i = 0; i < ndim; i++) {
        r->dims[i] = exact_int(PyTuple_GET_ITEM(shape, i), &ok);
        if (!ok || r->dims[i] < 1 || r->dims[i] >= MAX_ROW_ELEMS) return 1;
        elems *= r->dims[i];
        if (elems >= MAX_ROW_ELEMS) return 1;
    }
    PyObject *lay = get(d, K_RAGGED);
    if (lay == NULL || (lay == Py_None) == f->ragged) return 1;
    if (f->ragged) {
        PyObject *ld = PyObject_GenericGetDict(lay, NULL);
        if (ld == NULL) {
            PyErr_Clear();
            return 1;
        }
        if (!PyDict_Check(ld)) {
            Py_DECREF(ld);
            return 1;
        }
        r->lay_rows = exact_int(get(ld, K_ROWS), &ok);
        r->lay_values = exact_int(get(ld, K_VALUES), &ok);
        r->cb = (int32_t)exact_int(get(ld, K_COUNT_BYTES), &ok);
        r->block = exact_int(get(ld, K_BLOCK_ROWS), &ok);
        Py_DECREF(ld);
        if (!ok) return 1;
        if (r->cb != 1 && r->cb != 2 && r->cb != 4) return 1;
        if (r->lay_rows < 0 || r->lay_rows >= MAX_EXTENT || r->lay_values < 0 ||
            r->lay_values >= MAX_EXTENT || r->block < 1 || r->block >= MAX_EXTENT)
            return 1;
        if (r->block > BLOCK_ROWS && r->block > r->lay_rows) return 1;
        if (r->first + r->rows > r->lay_rows) return 1;
        r->has_layout = 1;
    }
    f->nrecs++;
    return 0;
}

static int by_position(const void *a, const void *b) {
    const Rec *x = a, *y = b;
    if (x->pos != y->pos) return x->pos < y->pos ? -1 : 1;
    if (x->rows != y->rows) return x->rows < y->rows ? -1 : 1;
    return 0;
}

static int meets_window(const Field *f, const Rec *r) {
    for (Py_ssize_t i = 0; i < f->nranges; i++)
        if (r->pos < f->hi[i] && f->lo[i] < r->pos + r->rows) return 1;
    return 0;
}

/* Every row of the record lies in the union of the window's ranges. */
static int inside_window(const Field *f, const Rec *r) {
    int64_t at = r->pos, end = r->pos + r->rows;
    int moved = 1;
    while (at < end && moved) { /* extend the covered prefix by any range holding `at` */
        moved = 0;
        for (Py_ssize_t i = 0; i < f->nranges; i++)
            if (f->lo[i] <= at && at < f->hi[i]) {
                at = f->hi[i];
                moved = 1;
            }
    }
    return at >= end;
}

/* Sort, refuse overlaps, pin a fixed field's dtype and shape, mark the records read.
 * 0 taken, 1 declined. */
static int settle_field(Field *f) {
    if (f->nrecs == 0) return 0;
    qsort(f->recs, f->nrecs, sizeof(Rec), by_position);
    Py_ssize_t live = 0;
    while (live < f->nrecs && f->recs[live].rows == 0) live++;
    f->first_live = live;
    if (live == f->nrecs) return 1; /* placeholders only */
    for (Py_ssize_t i = live + 1; i < f->nrecs; i++)
        if (f->recs[i].pos < f->recs[i - 1].pos + f->recs[i - 1].rows) return 1;
    int any = 0;
    for (Py_ssize_t i = 0; i < f->nrecs; i++) {
        Rec *r = &f->recs[i];
        if (!f->ragged) { /* one stored dtype and one row shape for the whole field */
            Rec *z = &f->recs[0];
            if (r->dtype != z->dtype || r->ndim != z->ndim) return 1;
            for (int k = 0; k < r->ndim; k++)
                if (r->dims[k] != z->dims[k]) return 1;
        }
        r->read = r->rows > 0 && (f->ragged || meets_window(f, r));
        if (r->read && f->ragged)
            r->whole = r->first == 0 && r->rows == r->lay_rows && inside_window(f, r);
        any |= r->read;
    }
    return any ? 0 : 1; /* a fixed field read nowhere: its shape comes from a header */
}

static PyTypeObject PlanType;

static PyObject *plan(PyObject *module, PyObject *args) {
    (void)module;
    PyObject *segments, *specs;
    if (!PyArg_ParseTuple(args, "OO!", &segments, &PyTuple_Type, &specs)) return NULL;
    PyObject *segs = PySequence_Fast(segments, "segments: a sequence");
    if (segs == NULL) return NULL;
    PyObject *names = PyDict_New(), *file_index = PyDict_New();
    Plan *p = PyObject_New(Plan, &PlanType);
    PyObject *result = NULL;
    if (p == NULL) goto done;
    p->fields = NULL;
    p->nfields = 0;
    p->lease_of = NULL;
    p->files = NULL;
    p->all_files = PyList_New(0);
    if (names == NULL || file_index == NULL || p->all_files == NULL) goto done;
    Py_ssize_t nf = PyTuple_GET_SIZE(specs);
    p->fields = calloc(nf ? nf : 1, sizeof(Field));
    if (p->fields == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    int verdict = 0;
    for (Py_ssize_t i = 0; i < nf && verdict == 0; i++) {
        p->nfields = i + 1;
        verdict = parse_spec(PyTuple_GET_ITEM(specs, i), &p->fields[i]);
        if (verdict == 0) {
            PyObject *num = PyLong_FromSsize_t(i);
            if (num == NULL || PyDict_SetItem(names, p->fields[i].name, num) < 0) verdict = -1;
            Py_XDECREF(num);
        }
    }
    Py_ssize_t ns = PySequence_Fast_GET_SIZE(segs);
    PyObject **items = PySequence_Fast_ITEMS(segs);
    for (Py_ssize_t i = 0; i < ns && verdict == 0; i++) {
        PyObject *d = PyObject_GenericGetDict(items[i], NULL);
        if (d == NULL) {
            PyErr_Clear();
            verdict = 1;
            break;
        }
        PyObject *field = PyDict_Check(d) ? get(d, K_FIELD) : NULL;
        PyObject *at = field != NULL && PyUnicode_CheckExact(field)
                           ? PyDict_GetItemWithError(names, field)
                           : NULL;
        if (at == NULL)
            verdict = PyErr_Occurred() ? -1 : field == NULL || !PyUnicode_CheckExact(field);
        else {
            int32_t file;
            verdict = take_record(&p->fields[PyLong_AsSsize_t(at)], d, file_index, p->all_files,
                                  &file);
        }
        Py_DECREF(d);
    }
    for (Py_ssize_t i = 0; i < p->nfields && verdict == 0; i++)
        verdict = settle_field(&p->fields[i]);
    if (verdict < 0) goto done;
    if (verdict > 0) {
        result = Py_None;
        Py_INCREF(result);
        goto done;
    }
    Py_ssize_t na = PyList_GET_SIZE(p->all_files);
    p->lease_of = malloc((na ? na : 1) * sizeof(int32_t));
    p->files = PyList_New(0);
    if (p->lease_of == NULL || p->files == NULL) goto done;
    for (Py_ssize_t i = 0; i < na; i++) p->lease_of[i] = -1;
    for (Py_ssize_t i = 0; i < p->nfields; i++)
        for (Py_ssize_t j = 0; j < p->fields[i].nrecs; j++) {
            Rec *r = &p->fields[i].recs[j];
            if (!r->read || p->lease_of[r->file] >= 0) continue;
            p->lease_of[r->file] = (int32_t)PyList_GET_SIZE(p->files);
            if (PyList_Append(p->files, PyList_GET_ITEM(p->all_files, r->file)) < 0) goto done;
        }
    result = (PyObject *)p;
    p = NULL;
done:
    Py_XDECREF(p);
    Py_XDECREF(names);
    Py_XDECREF(file_index);
    Py_DECREF(segs);
    return result;
}

/* ---- reading ------------------------------------------------------------------------------ */

typedef struct {
    const int *fds;
    const int64_t *size, *file_id, *header_size;
} Files;

/* The record's claims against its file, before any allocation. 1 when they hold. */
static int fits(const Field *f, const Rec *r, const Files *fl, int32_t li) {
    int64_t hsize = REGION_HEADER + f->key_len;
    if (r->file_id == 0) return 0; /* no file id for a file that has one: refused there */
    if (r->file_id != fl->file_id[li]) return 0; /* stale: reopened there */
    if (r->offset - hsize < fl->header_size[li]) return 0;
    int64_t room = fl->size[li] - r->offset;
    if (room < 0) return 0;
    if (!f->ragged) {
        int64_t rb = ITEMSIZE[r->dtype];
        for (int k = 0; k < r->ndim; k++) rb *= r->dims[k];
        return r->first + r->rows <= room / rb;
    }
    int64_t size = ITEMSIZE[r->dtype];
    if (r->lay_rows > room || r->lay_values > room / size) return 0;
    return values_start(r->lay_rows, r->cb, r->block) + size * r->lay_values <= room;
}

/* The region header before the record's body, as the writer wrote it; 1 when it agrees. */
static int header_agrees(const Field *f, const Rec *r, const unsigned char *h, int64_t size,
                         int64_t file_id) {
    int64_t rb = ITEMSIZE[r->dtype], elems = 1;
    for (int k = 0; k < r->ndim; k++) elems *= r->dims[k];
    rb *= elems;
    if (memcmp(h, "RGN3", 4) != 0) return 0;
    if (h[4] != (f->ragged ? 1 : 0) || h[5] != (f->ragged ? r->cb : 0)) return 0;
    if (h[6] != r->dtype || h[7] != f->key_len) return 0;
    uint64_t block = load_le(h + 8, 4);
    uint64_t want_block = f->ragged ? (uint64_t)r->block /* checksum.fixed_block_rows: */
                                    : (uint64_t)(rb >= BLOCK_BYTES ? 1 : BLOCK_BYTES / rb);
    if (block != want_block) return 0;
    uint64_t rows = load_le(h + 12, 8), values = load_le(h + 20, 8), body = load_le(h + 28, 8);
    if (load_le(h + 36, 8) != (uint64_t)file_id) return 0;
    if (h[44] != r->ndim || h[45] != 1) return 0; /* row dims; checksum kind CRC-32C */
    if (h[46] != (f->ragged && f->lead ? 1 : 0) || h[47] != 0) return 0; /* row flags, pad */
    for (int k = 0; k < MAX_NDIM; k++)
        if (load_le(h + 48 + 4 * k, 4) != (uint64_t)(k < r->ndim ? r->dims[k] : 0)) return 0;
    if (memcmp(h + REGION_HEADER, f->key, f->key_len) != 0) return 0;
    if (rows >= (uint64_t)MAX_EXTENT || values >= (uint64_t)MAX_EXTENT ||
        body >= (uint64_t)MAX_EXTENT)
        return 0;
    if ((uint64_t)(r->first + r->rows) > rows) return 0;
    int64_t room = size - r->offset;
    if (!f->ragged)
        return body % rb == 0 && body / rb == rows && (int64_t)body <= room &&
               values / elems == rows && values % elems == 0;
    return (int64_t)rows == r->lay_rows && (int64_t)values == r->lay_values &&
           (int64_t)body == values_start(r->lay_rows, r->cb, r->block) +
                                ITEMSIZE[r->dtype] * r->lay_values;
}

/* Decode the record's rows [first, first + rows) from its index blocks into counts / starts
 * (value indexes in the region); 1 when every block read is consistent. */
static inline int64_t count_at(const unsigned char *q, int cb) {
    return cb == 1   ? q[0]
           : cb == 2 ? q[0] | q[1] << 8
                     : q[0] | q[1] << 8 | q[2] << 16 | (int64_t)q[3] << 24;
}

/* Decode the record's rows [first, first + rows) from its index blocks into counts / starts
 * (value indexes in the region); 1 when every block read is consistent: its offset chains on
 * from the block before, its values stay inside the region's, and the region's last block ends
 * at the region's last value. Rows of a block outside the record only advance the offset. */
static int decode_rows(const Rec *r, const unsigned char *idx, int64_t *counts, int64_t *starts,
                       int64_t *widest) {
    int64_t B = r->block, cb = r->cb, per = 8 + B * cb, V = r->lay_values, wide = *widest;
    int64_t k0 = r->first / B, k1 = (r->first + r->rows - 1) / B;
    int64_t last_block = div_up(r->lay_rows, B) - 1, prev_end = 0;
    for (int64_t k = k0; k <= k1; k++) {
        const unsigned char *blk = idx + (k - k0) * per, *q = blk + 8;
        uint64_t off = load_le(blk, 8);
        if (off > (uint64_t)V || (k > k0 && (int64_t)off != prev_end)) return 0;
        int64_t at = (int64_t)off, i = 0;
        int64_t lo = k == k0 ? r->first - k * B : 0;
        int64_t hi = k == k1 ? r->first + r->rows - k * B : B;
        int64_t base = k * B - r->first; /* row of the record at i = 0 (< 0 before it) */
        for (; i < lo; i++)
            if ((at += count_at(q + i * cb, cb)) > V) return 0;
        for (; i < hi; i++) {
            int64_t c = count_at(q + i * cb, cb);
            counts[base + i] = c;
            starts[base + i] = at;
            wide = c > wide ? c : wide;
            if ((at += c) > V) return 0;
        }
        for (; i < B; i++)
            if ((at += count_at(q + i * cb, cb)) > V) return 0;
        prev_end = at;
        if (k == last_block && at != V) return 0;
    }
    *widest = wide;
    return 1;
}

/* The loops below stay out of line: inlined into Plan_read, GCC 12 compiles them several times
 * slower (a fill loop measured 180 us against 50 us for 1.2 MB). */

/* Rows of one piece into the output's values: row i holds cn[i] values starting at value
 * st[i] - st[0] of raw (stored as `size`-byte little-endian integers: 1, 2, 3; 4 is int32 or
 * float32, copied as is), landing from out[dst[i] - dst[0] + lead] on (dst: the output offsets
 * of the piece's rows; `lead` 1 leaves each row's label slot to the caller).
 *
 * Branch-free over values, not rows (most rows hold 0-2 values, and a loop per row paid a
 * mispredicted exit each): value v of row i lands at v + g[i] with g[i] = dst[i] - dst[0] + lead
 * - (st[i] - st[0]), so a difference array holding g[i] - g[i - 1] at each row's first value,
 * summed as the values go, gives every destination (empty rows add at the same place as the
 * next row; diff holds one more entry for trailing empty rows). 16k rows: 25 us, against
 * 100-145 us a row at a time. */
#define SCATTER_ROWS(NAME, SIZE, LOAD)                                                        \
    static void __attribute__((noinline))                                                     \
    NAME(int32_t *restrict out, const int64_t *restrict dst, int64_t lead,                    \
         const int64_t *restrict cn, const int64_t *restrict st, int64_t m,                   \
         const unsigned char *restrict raw, int64_t *restrict diff) {                         \
        int64_t s0 = st[0], d0 = dst[0], total = st[m - 1] + cn[m - 1] - s0, prev = 0, acc = 0; \
        memset(diff, 0, sizeof(int64_t) * (total + 1));                                       \
        for (int64_t i = 0; i < m; i++) {                                                     \
            int64_t g = dst[i] - d0 + lead - (st[i] - s0);                                    \
            diff[st[i] - s0] += g - prev;                                                     \
            prev = g;                                                                         \
        }                                                                                     \
        for (int64_t v = 0; v < total; v++) {                                                 \
            const unsigned char *q = raw + v * SIZE;                                          \
            acc += diff[v];                                                                   \
            out[v + acc] = LOAD;                                                              \
        }                                                                                     \
    }
SCATTER_ROWS(rows_u8, 1, q[0])
SCATTER_ROWS(rows_u16, 2, q[0] | q[1] << 8)
SCATTER_ROWS(rows_u24, 3, q[0] | q[1] << 8 | q[2] << 16)
SCATTER_ROWS(rows_32, 4, (int32_t)(q[0] | q[1] << 8 | q[2] << 16 | (uint32_t)q[3] << 24))

static void scatter_rows(int32_t *out, const int64_t *dst, int64_t lead, const int64_t *cn,
                         const int64_t *st, int64_t m, const unsigned char *raw, int64_t *diff,
                         int dtype) {
    switch (dtype) {
    case 0:
        return rows_u8(out, dst, lead, cn, st, m, raw, diff);
    case 2:
        return rows_u16(out, dst, lead, cn, st, m, raw, diff);
    case CODE_UINT24:
        return rows_u24(out, dst, lead, cn, st, m, raw, diff);
    default: /* int32, float32: the bits as stored */
        return rows_32(out, dst, lead, cn, st, m, raw, diff);
    }
}

/* Each row's label slot (out[dst[i]]) at its label (`size`-byte integers; NULL: the fill).
 * 0, or 1 for a label an int32 id cannot hold (the planned reader's error). */
static int __attribute__((noinline)) put_labels(int32_t *restrict out, const int64_t *restrict dst,
                                                int64_t m, const void *labels, int size,
                                                int32_t fill) {
    if (labels == NULL) {
        for (int64_t i = 0; i < m; i++) out[dst[i]] = fill;
    } else if (size == 4) {
        const int32_t *l = labels;
        for (int64_t i = 0; i < m; i++) out[dst[i]] = l[i];
    } else {
        const int64_t *l = labels;
        int64_t bad = 0;
        for (int64_t i = 0; i < m; i++) {
            bad |= l[i] != (int32_t)l[i];
            out[dst[i]] = (int32_t)l[i];
        }
        return bad != 0;
    }
    return 0;
}

/* Overlap of live record r with window range i: rows [a, b) in positions, or 0 when none. */
static int piece(const Field *f, const Rec *r, Py_ssize_t i, int64_t *a, int64_t *b) {
    *a = r->pos > f->lo[i] ? r->pos : f->lo[i];
    *b = r->pos + r->rows < f->hi[i] ? r->pos + r->rows : f->hi[i];
    return *a < *b;
}

/* (name, values, coverage, dtype code, row shape, offsets, widest) of a field read: a fixed
 * field's offsets None and widest 0, a ragged field's row shape (). */
static PyObject *field_result(const Field *f, PyObject *values, PyObject *coverage,
                              PyObject *offsets) {
    const Rec *z = &f->recs[0];
    int ragged_code = f->allowed & (1 << CODE_FLOAT32) ? CODE_FLOAT32 : CODE_INT32;
    PyObject *shape = PyTuple_New(f->ragged ? 0 : z->ndim);
    if (shape == NULL) return NULL;
    for (int k = 0; k < PyTuple_GET_SIZE(shape); k++) {
        PyObject *dim = PyLong_FromLongLong(z->dims[k]);
        if (dim == NULL) {
            Py_DECREF(shape);
            return NULL;
        }
        PyTuple_SET_ITEM(shape, k, dim);
    }
    return Py_BuildValue("(OOOiNOL)", f->name, values, coverage,
                         f->ragged ? ragged_code : z->dtype, shape, offsets ? offsets : Py_None,
                         (long long)(f->ragged ? f->widest : 0));
}

/* One read in progress: the plan, the files as the lease opened them, and every buffer. */
typedef struct {
    Plan *p;
    Files fl;
    unsigned char *hbuf, *ibuf, *vbuf, *v2buf; /* headers, CSR indexes, values whole / in part */
    int64_t *counts, *starts;                  /* the rows of every ragged record read */
    int64_t *diff, diff_cap;                   /* scatter_rows' scratch */
    PyObject **values, **coverage, **offsets;  /* per field: the outputs (bytearrays) */
    int64_t max_output;                        /* bytes one field's values may take */
    Ranges rs;
} Read;

enum { TAKEN = 0, DECLINED = 1, FAILED = -1 }; /* FAILED: a Python error is set */

static int64_t row_bytes(const Rec *r) {
    int64_t rb = ITEMSIZE[r->dtype];
    for (int k = 0; k < r->ndim; k++) rb *= r->dims[k];
    return rb;
}

/* A bytearray of `size` bytes, grown from an empty one: when the allocation of
 * PyByteArray_FromStringAndSize(NULL, size) fails, CPython 3.11 frees the half-made object before
 * it has set its export count, which then reads as garbage and prints "SystemError: deallocated
 * bytearray object has exported buffers"; a failed resize leaves a sound empty object. */
static PyObject *new_bytearray(int64_t size) {
    PyObject *b = PyByteArray_FromStringAndSize(NULL, 0);
    if (b != NULL && size > 0 && PyByteArray_Resize(b, (Py_ssize_t)size) < 0) Py_CLEAR(b);
    return b;
}

static int new_output(Read *rd, Py_ssize_t i, int64_t bytes) {
    Field *f = &rd->p->fields[i];
    rd->values[i] = new_bytearray(bytes);
    rd->coverage[i] = new_bytearray(f->n);
    if (rd->values[i] == NULL || rd->coverage[i] == NULL) return FAILED;
    memset(PyByteArray_AS_STRING(rd->coverage[i]), 0, f->n);
    return TAKEN;
}

/* Every claim against its file, then the buffers, sized by what the files hold. */
static int claim(Read *rd, int64_t parallel_min) {
    Plan *p = rd->p;
    int64_t hbytes = 0, ibytes = 0, vbytes = 0, rows_total = 0, total = 0;
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Field *f = &p->fields[i];
        for (Py_ssize_t j = 0; j < f->nrecs; j++) {
            Rec *r = &f->recs[j];
            if (!r->read) continue;
            if (!fits(f, r, &rd->fl, p->lease_of[r->file])) return DECLINED;
            r->hslot = hbytes;
            hbytes += REGION_HEADER + f->key_len;
            if (!f->ragged) continue;
            int64_t B = r->block, per = 8 + B * r->cb;
            r->islot = ibytes;
            ibytes += ((r->first + r->rows - 1) / B - r->first / B + 1) * per;
            r->row_base = rows_total;
            rows_total += r->rows;
            if (r->whole) {
                r->vslot = vbytes;
                vbytes += values_start(r->lay_rows, r->cb, B) -
                          index_bytes(r->lay_rows, r->cb, B) + ITEMSIZE[r->dtype] * r->lay_values;
            }
        }
        int64_t nb;
        if (!f->ragged && f->nrecs) {
            if (__builtin_mul_overflow(f->n, row_bytes(&f->recs[0]), &nb)) return DECLINED;
            if (nb > rd->max_output) return DECLINED; /* the planned reader's bound error */
            total += nb;
        }
    }
    if (total + hbytes + ibytes + vbytes >= parallel_min) return DECLINED; /* the thread pool's */
    rd->hbuf = malloc(hbytes ? hbytes : 1);
    rd->ibuf = calloc(ibytes ? ibytes : 1, 1); /* lengths past a region's last row read as 0 */
    rd->vbuf = malloc(vbytes ? vbytes : 1);
    rd->counts = malloc(2 * (rows_total ? rows_total : 1) * sizeof(int64_t));
    if (!rd->hbuf || !rd->ibuf || !rd->vbuf || !rd->counts) {
        PyErr_NoMemory();
        return FAILED;
    }
    rd->starts = rd->counts + rows_total;
    return TAKEN;
}

/* Headers; fixed rows straight into their output; ragged indexes, and the values of records
 * read whole. */
static int first_pass(Read *rd) {
    Plan *p = rd->p;
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Field *f = &p->fields[i];
        if (f->nrecs == 0) continue;
        int64_t hsize = REGION_HEADER + f->key_len, rb = row_bytes(&f->recs[0]);
        if (!f->ragged && new_output(rd, i, f->n * rb) < 0) return FAILED;
        for (Py_ssize_t j = 0; j < f->nrecs; j++) {
            Rec *r = &f->recs[j];
            if (!r->read) continue;
            int32_t li = p->lease_of[r->file];
            if (push_range(&rd->rs, li, r->offset - hsize, hsize, (char *)rd->hbuf + r->hslot) < 0)
                goto nomem;
            if (!f->ragged) {
                char *dst = PyByteArray_AS_STRING(rd->values[i]);
                char *cov = PyByteArray_AS_STRING(rd->coverage[i]);
                int64_t at = 0, a, b;
                for (Py_ssize_t k = 0; k < f->nranges; at += f->hi[k] - f->lo[k], k++) {
                    if (!piece(f, r, k, &a, &b)) continue;
                    int64_t src = r->offset + (r->first + a - r->pos) * rb;
                    int64_t row = at + a - f->lo[k];
                    if (push_range(&rd->rs, li, src, (b - a) * rb, dst + row * rb) < 0)
                        goto nomem;
                    memset(cov + row, 1, b - a);
                }
                continue;
            }
            int64_t B = r->block, per = 8 + B * r->cb;
            int64_t k0 = r->first / B, k1 = (r->first + r->rows - 1) / B;
            int64_t ib = index_bytes(r->lay_rows, r->cb, B);
            int64_t end = (k1 + 1) * per < ib ? (k1 + 1) * per : ib;
            if (push_range(&rd->rs, li, r->offset + k0 * per, end - k0 * per,
                           (char *)rd->ibuf + r->islot) < 0)
                goto nomem;
            int64_t vend = values_start(r->lay_rows, r->cb, B) + ITEMSIZE[r->dtype] * r->lay_values;
            if (r->whole && push_range(&rd->rs, li, r->offset + ib, vend - ib,
                                       (char *)rd->vbuf + r->vslot) < 0)
                goto nomem;
        }
    }
    return issue(&rd->rs, rd->fl.fds) < 0 ? DECLINED : TAKEN;
nomem:
    PyErr_NoMemory();
    return FAILED;
}

/* Runs BODY for each piece of a ragged record of field f the window reads: positions [a, b),
 * landing at output rows from `row` on, its rows from ri to `last` in counts / starts, its
 * values [v0, v1) of the region's. */
#define FOR_FIELD_PIECES(rd, f, BODY)                                                         \
    for (Py_ssize_t j = (f)->first_live; j < (f)->nrecs; j++) {                               \
        Rec *r = &(f)->recs[j];                                                               \
        int64_t at = 0, a, b;                                                                 \
        for (Py_ssize_t k = 0; k < (f)->nranges; at += (f)->hi[k] - (f)->lo[k], k++) {        \
            if (!piece((f), r, k, &a, &b)) continue;                                          \
            int64_t row = at + a - (f)->lo[k], ri = r->row_base + a - r->pos;                 \
            int64_t last = ri + b - a - 1;                                                    \
            int64_t v0 = (rd)->starts[ri], v1 = (rd)->starts[last] + (rd)->counts[last];      \
            (void)row, (void)v0, (void)v1;                                                    \
            BODY                                                                              \
        }                                                                                     \
    }

/* The same for every ragged field (field index i, field f). */
#define FOR_RAGGED_PIECES(rd, BODY)                                                           \
    for (Py_ssize_t i = 0; i < (rd)->p->nfields; i++) {                                       \
        Field *f = &(rd)->p->fields[i];                                                       \
        if (f->ragged) FOR_FIELD_PIECES(rd, f, BODY)                                          \
    }

/* A ragged field's output rows: covered rows hold their values after the label slot (lead),
 * uncovered rows are empty; offsets [n + 1] made, values [nnz] and coverage allocated. */
static int ragged_output(Read *rd, Py_ssize_t i) {
    Field *f = &rd->p->fields[i];
    int64_t bytes, n = f->n, *off;
    if (__builtin_mul_overflow(n + 1, 8, &bytes)) return DECLINED;
    if (bytes > rd->max_output) return DECLINED; /* the planned reader's bound error */
    if ((rd->offsets[i] = new_bytearray(bytes)) == NULL) return FAILED;
    off = (int64_t *)PyByteArray_AS_STRING(rd->offsets[i]);
    memset(off, 0, bytes);
    FOR_FIELD_PIECES(rd, f, {
        for (int64_t t = 0; t < b - a; t++) off[row + t + 1] = rd->counts[ri + t] + f->lead;
    })
    for (int64_t k = 1; k <= n; k++) off[k] += off[k - 1];
    if (off[n] > (rd->max_output - bytes) / 4) return DECLINED;
    return new_output(rd, i, 4 * off[n]);
}

/* Every record read held to its region header; the CSR indexes decoded; each ragged field's
 * widest row, and its output. */
static int hold_to_headers(Read *rd) {
    Plan *p = rd->p;
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Field *f = &p->fields[i];
        int64_t widest = 0;
        for (Py_ssize_t j = 0; j < f->nrecs; j++) {
            Rec *r = &f->recs[j];
            if (!r->read) continue;
            int32_t li = p->lease_of[r->file];
            if (!header_agrees(f, r, rd->hbuf + r->hslot, rd->fl.size[li], rd->fl.file_id[li]))
                return DECLINED;
            if (f->ragged && !decode_rows(r, rd->ibuf + r->islot, rd->counts + r->row_base,
                                          rd->starts + r->row_base, &widest))
                return DECLINED;
        }
        if (!f->ragged || f->nrecs == 0) continue;
        f->widest = widest + f->lead;
        if (f->width >= 0 && f->widest > f->width) return DECLINED; /* the planned reader's */
        int verdict = ragged_output(rd, i);
        if (verdict != TAKEN) return verdict;
    }
    return TAKEN;
}

/* The values of records read in part, now that their index says where they lie. */
static int second_pass(Read *rd) {
    int64_t bytes = 0, at2 = 0;
    FOR_RAGGED_PIECES(rd, if (!r->whole) bytes += ITEMSIZE[r->dtype] * (v1 - v0);)
    rd->rs.n = 0;
    if ((rd->v2buf = malloc(bytes ? bytes : 1)) == NULL) goto nomem;
    FOR_RAGGED_PIECES(rd, {
        if (r->whole) continue;
        int64_t size = ITEMSIZE[r->dtype];
        int64_t src = r->offset + values_start(r->lay_rows, r->cb, r->block) + size * v0;
        if (push_range(&rd->rs, rd->p->lease_of[r->file], src, size * (v1 - v0),
                       (char *)rd->v2buf + at2) < 0)
            goto nomem;
        at2 += size * (v1 - v0);
    })
    return issue(&rd->rs, rd->fl.fds) < 0 ? DECLINED : TAKEN;
nomem:
    PyErr_NoMemory();
    return FAILED;
}

/* Ragged rows into their values, label slots put; fixed gaps at the fill. */
static int fill(Read *rd) {
    Plan *p = rd->p;
    for (Py_ssize_t i = 0; i < p->nfields; i++) {
        Field *f = &p->fields[i];
        if (f->nrecs == 0 || f->ragged) continue;
        char *cov = PyByteArray_AS_STRING(rd->coverage[i]);
        char *dst = PyByteArray_AS_STRING(rd->values[i]);
        const Rec *z = &f->recs[0];
        int64_t rb = row_bytes(z), isz = ITEMSIZE[z->dtype];
        for (int64_t row = 0; row < f->n; row++)
            for (int64_t e = 0; !cov[row] && e < rb; e += isz)
                memcpy(dst + row * rb + e, f->fills[z->dtype], isz);
    }
    int64_t at2 = 0;
    FOR_RAGGED_PIECES(rd, {
        int64_t size = ITEMSIZE[r->dtype];
        /* src holds the region's values from value `origin` on */
        const unsigned char *src = rd->v2buf + at2;
        int64_t origin = v0;
        if (r->whole) {
            src = rd->vbuf + r->vslot + values_start(r->lay_rows, r->cb, r->block) -
                  index_bytes(r->lay_rows, r->cb, r->block);
            origin = 0;
        } else
            at2 += size * (v1 - v0);
        if (v1 - v0 + 1 > rd->diff_cap) {
            free(rd->diff);
            rd->diff_cap = 2 * (v1 - v0 + 1);
            if ((rd->diff = malloc(sizeof(int64_t) * rd->diff_cap)) == NULL) goto nomem;
        }
        int32_t *out = (int32_t *)PyByteArray_AS_STRING(rd->values[i]);
        const int64_t *dst = (const int64_t *)PyByteArray_AS_STRING(rd->offsets[i]) + row;
        memset(PyByteArray_AS_STRING(rd->coverage[i]) + row, 1, b - a);
        if (v1 > v0)
            scatter_rows(out + dst[0], dst, f->lead, rd->counts + ri, rd->starts + ri, b - a,
                         src + size * (v0 - origin), rd->diff, r->dtype);
        if (f->lead) {
            int32_t value;
            memcpy(&value, f->fills[CODE_INT32], 4);
            int size = (int)f->labels.itemsize;
            const char *labels = f->labels.buf ? (const char *)f->labels.buf + size * row : NULL;
            if (put_labels(out, dst, b - a, labels, size, value)) return DECLINED;
        }
    })
    return TAKEN;
nomem:
    PyErr_NoMemory();
    return FAILED;
}

static PyObject *results(Read *rd) {
    PyObject *out = PyList_New(0);
    for (Py_ssize_t i = 0; out != NULL && i < rd->p->nfields; i++) {
        Field *f = &rd->p->fields[i];
        if (f->nrecs == 0) continue;
        PyObject *item = field_result(f, rd->values[i], rd->coverage[i], rd->offsets[i]);
        if (item == NULL || PyList_Append(out, item) < 0) Py_CLEAR(out);
        Py_XDECREF(item);
    }
    return out;
}

static PyObject *Plan_read(Plan *p, PyObject *args) {
    PyObject *entries, *result = NULL;
    long long parallel_min, max_output;
    if (!PyArg_ParseTuple(args, "O!LL", &PyList_Type, &entries, &parallel_min, &max_output))
        return NULL;
    Py_ssize_t nfiles = PyList_GET_SIZE(p->files), nf = p->nfields ? p->nfields : 1;
    int *fds = malloc((nfiles ? nfiles : 1) * sizeof(int));
    int64_t *cols = malloc(3 * (nfiles ? nfiles : 1) * sizeof(int64_t));
    Read rd = {.p = p, .values = calloc(nf, sizeof(PyObject *)),
               .coverage = calloc(nf, sizeof(PyObject *)),
               .offsets = calloc(nf, sizeof(PyObject *)), .max_output = max_output};
    int verdict = FAILED;
    if (fds == NULL || cols == NULL || rd.values == NULL || rd.coverage == NULL ||
        rd.offsets == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyList_GET_SIZE(entries) != nfiles) {
        PyErr_SetString(PyExc_ValueError, "one open file per file of the plan");
        goto done;
    }
    /* each entry: .fd and .columns = (size, version, file id, file header size) */
    verdict = TAKEN;
    for (Py_ssize_t i = 0; i < nfiles && verdict == TAKEN; i++) {
        PyObject *e = PyList_GET_ITEM(entries, i), *fd = PyObject_GetAttr(e, KEYS[K_FD]);
        PyObject *c = fd ? PyObject_GetAttr(e, KEYS[K_COLUMNS]) : NULL;
        int ok = 1;
        if (c == NULL || !PyTuple_Check(c) || PyTuple_GET_SIZE(c) != 4) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "entry.columns: 4 ints");
            verdict = FAILED;
        } else {
            fds[i] = (int)exact_int(fd, &ok);
            cols[i] = exact_int(PyTuple_GET_ITEM(c, 0), &ok);
            if (exact_int(PyTuple_GET_ITEM(c, 1), &ok) != FORMAT_VERSION) verdict = DECLINED;
            cols[nfiles + i] = exact_int(PyTuple_GET_ITEM(c, 2), &ok);
            cols[2 * nfiles + i] = exact_int(PyTuple_GET_ITEM(c, 3), &ok);
            if (!ok && verdict == TAKEN) verdict = DECLINED;
        }
        Py_XDECREF(fd);
        Py_XDECREF(c);
    }
    rd.fl = (Files){fds, cols, cols + nfiles, cols + 2 * nfiles};
    if (verdict == TAKEN) verdict = claim(&rd, parallel_min);
    if (verdict == TAKEN) verdict = first_pass(&rd);
    if (verdict == TAKEN) verdict = hold_to_headers(&rd);
    if (verdict == TAKEN) verdict = second_pass(&rd);
    if (verdict == TAKEN) verdict = fill(&rd);
    if (verdict == TAKEN) result = results(&rd);
    if (verdict == DECLINED) {
        result = Py_None;
        Py_INCREF(result);
    }
done:
    for (Py_ssize_t i = 0; rd.values && rd.coverage && rd.offsets && i < p->nfields; i++) {
        Py_XDECREF(rd.values[i]);
        Py_XDECREF(rd.coverage[i]);
        Py_XDECREF(rd.offsets[i]);
    }
    free(rd.values);
    free(rd.coverage);
    free(rd.offsets);
    free(fds);
    free(cols);
    free(rd.hbuf);
    free(rd.ibuf);
    free(rd.vbuf);
    free(rd.v2buf);
    free(rd.counts);
    free(rd.diff);
    free(rd.rs.r);
    return result;
}

static PyObject *Plan_files(Plan *p, void *closure) {
    (void)closure;
    Py_INCREF(p->files);
    return p->files;
}

static PyMethodDef Plan_methods[] = {
    {"read", (PyCFunction)Plan_read, METH_VARARGS,
     "read(entries, parallel_min, max_output) -> [(name, values, coverage, dtype code, row "
     "shape)], or "
     "None (declined)"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Plan_getset[] = {
    {"files", (getter)Plan_files, NULL, "the files to open, in lease order", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyMethodDef module_methods[] = {
    {"plan", plan, METH_VARARGS, "plan(segments, specs) -> Plan, or None (declined)"},
    {NULL, NULL, 0, NULL}};

static PyTypeObject PlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "rollfeed.payload.read._window.Plan",
    .tp_basicsize = sizeof(Plan),
    .tp_dealloc = (destructor)Plan_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "One read of several fields over their windows, planned.",
    .tp_methods = Plan_methods,
    .tp_getset = Plan_getset,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "rollfeed.payload.read._window",
    .m_doc = "The compiled window read (see rollfeed.payload.read.compiled_read).",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__window(void) {
    const uint16_t one = 1;
    if (*(const unsigned char *)&one != 1) {
        PyErr_SetString(PyExc_ImportError, "the compiled window read needs a little-endian host");
        return NULL;
    }
    for (int k = 0; k < N_KEYS; k++)
        if ((KEYS[k] = PyUnicode_InternFromString(KEY_NAMES[k])) == NULL) return NULL;
    if (PyType_Ready(&PlanType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&PlanType);
    if (PyModule_AddObject(m, "Plan", (PyObject *)&PlanType) < 0) {
        Py_DECREF(&PlanType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
