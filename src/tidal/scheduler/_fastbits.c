/* Compiled kernels of the scheduling core (tidal.scheduler.kernels owns the
 * import). Each function computes exactly what a passage of nodebits, buddy,
 * greedy, elan_event, policies/elasticflow or policies/tidal, or of the simulator's
 * runset and views, computes, on the same arrays and objects, without the
 * interpreter's per-call and per-item
 * overhead (a Philly replay runs them hundreds of thousands of times, on a
 * few hundred entries or the ~90 jobs of a round). A case a kernel does not
 * cover (an array of another type, a shape numpy would reject, an index out
 * of range, an object not of the expected type) returns NotImplemented
 * before changing anything, and the caller runs its Python passage, which
 * gives the answer or raises as before; tests/test_fastbits.py compares the
 * two.
 *
 * Built by setup.py as an optional extension: without a C compiler the
 * package installs without it and the Python passages run alone. API (a
 * module constant) is raised whenever a function is added or changes its
 * arguments, so that a stale build is not used (kernels.py). */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

/* A C-contiguous buffer of ``obj`` (0): items of ``itemsize`` bytes whose
 * format is one of ``codes`` in native order, ``ndim`` dimensions (the last
 * ``cols`` wide when ndim is 2); or -1 when it is not one (nothing raised:
 * the caller hands the case back). */
static int
get_buffer(PyObject *obj, Py_buffer *view, const char *codes, Py_ssize_t itemsize, int ndim, Py_ssize_t cols,
           int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, view, flags) < 0) {
        PyErr_Clear();
        return -1;
    }
    const char *f = view->format;
#if PY_LITTLE_ENDIAN
    if (f && (f[0] == '@' || f[0] == '=' || f[0] == '<'))
#else
    if (f && (f[0] == '@' || f[0] == '=' || f[0] == '>'))
#endif
        f++;  /* native order */
    if (!f || !f[0] || f[1] || !strchr(codes, f[0]) || view->itemsize != itemsize || view->ndim != ndim ||
        (ndim == 2 && view->shape[1] != cols)) {
        PyBuffer_Release(view);
        return -1;
    }
    return 0;
}

/* A 1-d int64 / bool (numpy's ``?``) buffer, or a float64 one of ``ndim``
 * dimensions (``cols`` wide), as get_buffer. */
#define get_i64(obj, view, writable) get_buffer((obj), (view), "ql", 8, 1, 0, (writable))
#define get_bool(obj, view, writable) get_buffer((obj), (view), "?", 1, 1, 0, (writable))
#define get_f64(obj, view, ndim, cols, writable) get_buffer((obj), (view), "d", 8, (ndim), (cols), (writable))

static PyObject *
not_implemented(void)
{
    Py_RETURN_NOTIMPLEMENTED;
}

/* best_whole_nodes(free8, swf, s, sw_sz): NodeBits.best_whole_nodes. */
static PyObject *
best_whole_nodes(PyObject *self, PyObject *args)
{
    PyObject *free_obj, *swf_obj;
    Py_ssize_t s, sw_sz;
    if (!PyArg_ParseTuple(args, "OOnn", &free_obj, &swf_obj, &s, &sw_sz))
        return NULL;
    if (s < 8 || (s & (s - 1)) || sw_sz <= 0)
        return not_implemented();
    Py_buffer fv, sv;
    int have_sw = swf_obj != Py_None;
    if (get_i64(free_obj, &fv, 0) < 0)
        return not_implemented();
    if (have_sw && get_i64(swf_obj, &sv, 0) < 0) {
        PyBuffer_Release(&fv);
        return not_implemented();
    }
    const int64_t *free8 = (const int64_t *)fv.buf;
    const int64_t *swf = have_sw ? (const int64_t *)sv.buf : NULL;
    Py_ssize_t nodes = fv.shape[0], g = s / 8, nsw = have_sw ? sv.shape[0] : 0;
    PyObject *out = NULL;
    if (nodes % g) {  /* numpy's reshape would raise: let it */
        out = not_implemented();
        goto done;
    }
    Py_ssize_t nb = nodes / g, first = -1, count = 0;
    for (Py_ssize_t b = 0; b < nb; b++) {
        int64_t c = 0;
        for (Py_ssize_t k = b * g; k < (b + 1) * g; k++)
            c += free8[k];
        if (c == s) {
            if (first < 0)
                first = b;
            count++;
        }
    }
    if (count <= 1) {
        out = first < 0 ? (Py_INCREF(Py_None), Py_None) : PyLong_FromSsize_t(first * s);
        goto done;
    }
    if (nb % 2) {  /* the pairs' reshape would raise: let it */
        out = not_implemented();
        goto done;
    }
    Py_ssize_t best = -1;
    int64_t best_key = 0;
    for (Py_ssize_t b = first; b < nb; b++) {
        int64_t c = 0, pair = 0;
        for (Py_ssize_t k = b * g; k < (b + 1) * g; k++)
            c += free8[k];
        if (c != s)
            continue;
        Py_ssize_t lo = (b & ~(Py_ssize_t)1) * g;
        for (Py_ssize_t k = lo; k < lo + 2 * g; k++)
            pair += free8[k];
        int64_t key = pair * (int64_t)(sw_sz + 1);
        if (have_sw) {
            Py_ssize_t sw = (b * s) / sw_sz;
            if (sw >= nsw) {
                out = not_implemented();
                goto done;
            }
            key += swf[sw];
        }
        if (best < 0 || key < best_key) {
            best = b;
            best_key = key;
        }
    }
    out = PyLong_FromSsize_t(best * s);
done:
    PyBuffer_Release(&fv);
    if (have_sw)
        PyBuffer_Release(&sv);
    return out;
}

static int
popcount8(int64_t x)
{
    return __builtin_popcountll((unsigned long long)(x & 0xff));
}

/* set_range(bytes, free8, swf, lo, hi, used, nps): NodeBits.set_range. */
static PyObject *
set_range(PyObject *self, PyObject *args)
{
    PyObject *bytes_obj, *free_obj, *swf_obj, *used_obj;
    Py_ssize_t lo, hi, nps;
    if (!PyArg_ParseTuple(args, "OOOnnOn", &bytes_obj, &free_obj, &swf_obj, &lo, &hi, &used_obj, &nps))
        return NULL;
    int used = PyObject_IsTrue(used_obj);
    if (used < 0)
        return NULL;
    if (nps <= 0 || lo < 0 || hi < lo)
        return not_implemented();
    Py_buffer bv, fv, sv;
    int have_sw = swf_obj != Py_None;
    if (get_i64(bytes_obj, &bv, 1) < 0)
        return not_implemented();
    if (get_i64(free_obj, &fv, 1) < 0) {
        PyBuffer_Release(&bv);
        return not_implemented();
    }
    if (have_sw && get_i64(swf_obj, &sv, 1) < 0) {
        PyBuffer_Release(&bv);
        PyBuffer_Release(&fv);
        return not_implemented();
    }
    int64_t *bytes = (int64_t *)bv.buf, *free8 = (int64_t *)fv.buf, *swf = have_sw ? (int64_t *)sv.buf : NULL;
    Py_ssize_t nodes = bv.shape[0], nsw = have_sw ? sv.shape[0] : 0;
    PyObject *out = NULL;
    Py_ssize_t last = hi > lo ? (hi - 1) >> 3 : 0;
    if (fv.shape[0] != nodes || (hi > lo && last >= nodes) || (have_sw && hi > lo && last / nps >= nsw)) {
        out = not_implemented();  /* out of range: numpy slices and indexes as it does */
        goto done;
    }
    if ((lo & 7) == 0 && (hi & 7) == 0) {  /* whole nodes */
        Py_ssize_t n0 = lo >> 3, n1 = hi >> 3;
        for (Py_ssize_t n = n0; n < n1; n++) {
            if (have_sw)
                swf[n / nps] -= used ? free8[n] : free8[n] - 8;
            bytes[n] = used ? 255 : 0;
            free8[n] = used ? 0 : 8;
        }
    } else {
        while (lo < hi) {
            Py_ssize_t n = lo >> 3, end = (n + 1) << 3;
            if (end > hi)
                end = hi;
            int64_t mask = (((int64_t)1 << (end - lo)) - 1) << (lo & 7);
            int64_t old = bytes[n], new = used ? (old | mask) : (old & ~mask);
            if (new != old) {
                bytes[n] = new;
                int d = popcount8(new) - popcount8(old);
                free8[n] -= d;
                if (have_sw)
                    swf[n / nps] -= d;
            }
            lo = end;
        }
    }
    Py_INCREF(Py_None);
    out = Py_None;
done:
    PyBuffer_Release(&bv);
    PyBuffer_Release(&fv);
    if (have_sw)
        PyBuffer_Release(&sv);
    return out;
}

/* counts(used, bytes, free8, swf, nps): NodeBits' arrays of the bool mask
 * ``used`` (length 8 * len(bytes)), written into ``bytes``, ``free8`` and,
 * unless None, ``swf`` (len(bytes) / nps switches). */
static PyObject *
counts(PyObject *self, PyObject *args)
{
    PyObject *used_obj, *bytes_obj, *free_obj, *swf_obj;
    Py_ssize_t nps;
    if (!PyArg_ParseTuple(args, "OOOOn", &used_obj, &bytes_obj, &free_obj, &swf_obj, &nps))
        return NULL;
    if (nps <= 0)
        return not_implemented();
    Py_buffer uv, bv, fv, sv;
    int have_sw = swf_obj != Py_None;
    if (get_bool(used_obj, &uv, 0) < 0)
        return not_implemented();
    if (get_i64(bytes_obj, &bv, 1) < 0) {
        PyBuffer_Release(&uv);
        return not_implemented();
    }
    if (get_i64(free_obj, &fv, 1) < 0) {
        PyBuffer_Release(&uv);
        PyBuffer_Release(&bv);
        return not_implemented();
    }
    if (have_sw && get_i64(swf_obj, &sv, 1) < 0) {
        PyBuffer_Release(&uv);
        PyBuffer_Release(&bv);
        PyBuffer_Release(&fv);
        return not_implemented();
    }
    const unsigned char *used = (const unsigned char *)uv.buf;
    int64_t *bytes = (int64_t *)bv.buf, *free8 = (int64_t *)fv.buf, *swf = have_sw ? (int64_t *)sv.buf : NULL;
    Py_ssize_t nodes = bv.shape[0];
    PyObject *out;
    if (uv.shape[0] != 8 * nodes || fv.shape[0] != nodes || (have_sw && sv.shape[0] * nps != nodes)) {
        out = not_implemented();
    } else {
        if (have_sw)
            memset(swf, 0, sizeof(int64_t) * sv.shape[0]);
        for (Py_ssize_t n = 0; n < nodes; n++) {
            int64_t b = 0;
            for (int i = 0; i < 8; i++)
                b |= (int64_t)(used[8 * n + i] != 0) << i;
            bytes[n] = b;
            free8[n] = 8 - popcount8(b);
            if (have_sw)
                swf[n / nps] += free8[n];
        }
        Py_INCREF(Py_None);
        out = Py_None;
    }
    PyBuffer_Release(&uv);
    PyBuffer_Release(&bv);
    PyBuffer_Release(&fv);
    if (have_sw)
        PyBuffer_Release(&sv);
    return out;
}

/* first_free(used, prefer, s): the first aligned block of ``s`` GPUs around
 * a GPU of the tuple ``prefer`` (in its order) that is free in the bool mask
 * ``used``, or None (BuddyAllocator.best_fit_block's grow-in-place check). */
static PyObject *
first_free(PyObject *self, PyObject *args)
{
    PyObject *used_obj, *prefer;
    Py_ssize_t s;
    if (!PyArg_ParseTuple(args, "OOn", &used_obj, &prefer, &s))
        return NULL;
    if (s <= 0 || !PyTuple_Check(prefer))
        return not_implemented();
    Py_buffer uv;
    if (get_bool(used_obj, &uv, 0) < 0)
        return not_implemented();
    const unsigned char *used = (const unsigned char *)uv.buf;
    Py_ssize_t size = uv.shape[0], last = -1;
    PyObject *out = NULL;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(prefer); k++) {
        Py_ssize_t g = PyLong_AsSsize_t(PyTuple_GET_ITEM(prefer, k));
        if (g == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            out = not_implemented();
            goto done;
        }
        if (g < 0) {  /* Python's floor division and slicing: let them */
            out = not_implemented();
            goto done;
        }
        Py_ssize_t o = g / s * s;
        if (o == last)
            continue;
        last = o;
        if (o + s > size) {
            out = not_implemented();
            goto done;
        }
        Py_ssize_t i = o;
        while (i < o + s && !used[i])
            i++;
        if (i == o + s) {
            out = PyLong_FromSsize_t(o);
            goto done;
        }
    }
    Py_INCREF(Py_None);
    out = Py_None;
done:
    PyBuffer_Release(&uv);
    return out;
}

/* merge_cut(tables, free): the numpy part of tidal.scheduler.greedy._merge.
 * ``tables``: per job (in the queue's tie order) its chain of best steps, a
 * float64 array of rows (largest key so far, extra GPUs, need after, place).
 * The rows are taken in the order of a stable sort on the key; the GPUs
 * left after each row are ``free`` minus the extras so far; the merge stops
 * at the first row that leaves fewer than its need (before it if the GPUs
 * went negative). Returns (rows taken, rows taken per job, GPUs left, the
 * job of the stopping row when it was taken, else -1). */
typedef struct {
    double key;
    Py_ssize_t row;
} keyed_t;

static int
by_key_then_row(const void *a, const void *b)
{
    const keyed_t *x = (const keyed_t *)a, *y = (const keyed_t *)b;
    if (x->key < y->key)
        return -1;
    if (x->key > y->key)
        return 1;
    return (x->row > y->row) - (x->row < y->row);
}

/* The cut of merge_cut on ``tables`` (a list); a new (end, counts, left,
 * stop) tuple, NotImplemented, or NULL with an error set. */
static PyObject *
cut_tables(PyObject *tables, long long free_in)
{
    Py_ssize_t jobs = PyList_GET_SIZE(tables), rows = 0;
    if (jobs == 0)
        return not_implemented();
    Py_buffer *views = PyMem_Calloc(jobs, sizeof(Py_buffer));
    Py_ssize_t got = 0;
    PyObject *out = NULL;
    keyed_t *keyed = NULL;
    Py_ssize_t *owner = NULL, *took = NULL;
    const double **row_of = NULL;
    if (!views)
        return PyErr_NoMemory();
    for (; got < jobs; got++) {
        Py_buffer *v = &views[got];
        PyObject *table = PyList_GET_ITEM(tables, got);
        if (PyBytes_CheckExact(table)) {  /* a chain's rows as bytes (float64, 4 per row): no buffer to take */
            if (PyBytes_GET_SIZE(table) % 32 != 0) {
                out = not_implemented();
                goto done;
            }
            v->buf = PyBytes_AS_STRING(table);
            v->len = PyBytes_GET_SIZE(table);
            v->obj = NULL;  /* nothing to release */
            rows += v->len / 32;
            continue;
        }
        if (get_f64(table, v, 2, 4, 0) < 0) {
            out = not_implemented();
            goto done;
        }
        rows += v->len / 32;
    }
    if (rows == 0) {
        out = not_implemented();
        goto done;
    }
    keyed = PyMem_Malloc(rows * sizeof(keyed_t));
    owner = PyMem_Malloc(rows * sizeof(Py_ssize_t));
    row_of = PyMem_Malloc(rows * sizeof(double *));
    took = PyMem_Calloc(jobs, sizeof(Py_ssize_t));
    if (!keyed || !owner || !row_of || !took) {
        out = PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t r = 0;
    for (Py_ssize_t j = 0; j < jobs; j++) {
        const double *t = (const double *)views[j].buf;
        for (Py_ssize_t i = 0; i < views[j].len / 32; i++, r++) {
            if (t[4 * i] != t[4 * i]) {  /* NaN: numpy's sort order, not ours */
                out = not_implemented();
                goto done;
            }
            keyed[r].key = t[4 * i];
            keyed[r].row = r;
            owner[r] = j;
            row_of[r] = t + 4 * i;
        }
    }
    qsort(keyed, rows, sizeof(keyed_t), by_key_then_row);  /* (key, row): numpy's stable argsort */
    long long left = free_in, prev = free_in;
    Py_ssize_t end = rows, special = -1;
    for (Py_ssize_t k = 0; k < rows; k++) {
        const double *row = row_of[keyed[k].row];
        left -= (long long)row[1];
        if ((double)left < row[2]) {
            if (left < 0) {
                end = k;
                left = prev;
            } else {
                end = k + 1;
                special = owner[keyed[k].row];
            }
            break;
        }
        prev = left;
    }
    for (Py_ssize_t k = 0; k < end; k++)
        took[owner[keyed[k].row]]++;
    PyObject *counts = PyList_New(jobs);
    if (!counts)
        goto done;
    for (Py_ssize_t j = 0; j < jobs; j++) {
        PyObject *c = PyLong_FromSsize_t(took[j]);
        if (!c) {
            Py_DECREF(counts);
            goto done;
        }
        PyList_SET_ITEM(counts, j, c);
    }
    out = Py_BuildValue("nNLn", end, counts, left, special);
done:
    for (Py_ssize_t j = 0; j < got; j++)
        if (views[j].obj)
            PyBuffer_Release(&views[j]);
    PyMem_Free(views);
    PyMem_Free(keyed);
    PyMem_Free(owner);
    PyMem_Free(row_of);
    PyMem_Free(took);
    return out;
}

static PyObject *
merge_cut(PyObject *self, PyObject *args)
{
    PyObject *tables;
    long long free_in;
    if (!PyArg_ParseTuple(args, "O!L", &PyList_Type, &tables, &free_in))
        return NULL;
    return cut_tables(tables, free_in);
}

static PyObject *str_chains, *str_ext, *str_gain, *str_to;  /* Steps' attribute names, interned */

/* bisect_left (``right`` 0) or bisect_right (1) of x among ``n`` int
 * items (a tuple's or a list's), probing as Python's bisect does; -2 when a
 * probed item is not an int that fits a long long (nothing raised). */
static Py_ssize_t
bisect_ints_in(PyObject *const *items, Py_ssize_t n, long long x, int right)
{
    Py_ssize_t lo = 0, hi = n;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        int overflow = 0;
        long long v = PyLong_CheckExact(items[mid]) ? PyLong_AsLongLongAndOverflow(items[mid], &overflow) : 0;
        if (!PyLong_CheckExact(items[mid]) || overflow)
            return -2;
        if (right ? x < v : !(v < x))
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* bisect_right on a tuple of ints; -2 when an item is not a small int. */
#define bisect_ints(tup, x) bisect_ints_in(&PyTuple_GET_ITEM((tup), 0), PyTuple_GET_SIZE(tup), (x), 1)

/* merge_open(entries, jobs, cur, free, chain): tidal.scheduler.greedy._merge
 * (``chain``: its _chain, called for a chain not yet made); returns (GPUs
 * left, the queue's entries) and moves ``cur`` on, or NotImplemented (then
 * nothing was changed). */
static PyObject *
merge_open(PyObject *self, PyObject *args)
{
    PyObject *entries, *jobs, *cur, *chain_fn;
    long long free_in;
    if (!PyArg_ParseTuple(args, "O!O!O!LO", &PyDict_Type, &entries, &PyList_Type, &jobs, &PyDict_Type, &cur,
                          &free_in, &chain_fn))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    PyObject *keyed = PyList_New(n), *ranked = NULL, *chains = NULL, *tables = NULL, *cut = NULL, *heap = NULL;
    PyObject *out = NULL, *ents = NULL;  /* ents: entries[jid] per ranked job */
    PyObject *first_ddl = NULL;
    int same_ddl = 1;
    if (!keyed)
        return NULL;
    for (Py_ssize_t k = 0; k < n; k++) {  /* (deadline, job id): the queue's tie order */
        PyObject *jid = PyList_GET_ITEM(jobs, k), *e = PyDict_GetItemWithError(entries, jid);
        if (!e || !PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3) {
            if (!PyErr_Occurred())
                out = not_implemented();
            goto done;
        }
        PyObject *ddl = PyTuple_GET_ITEM(e, 2);
        if (k == 0)
            first_ddl = ddl;
        same_ddl = same_ddl && ddl == first_ddl;
        PyObject *pair = PyTuple_Pack(2, ddl, jid);
        if (!pair)
            goto done;
        PyList_SET_ITEM(keyed, k, pair);
    }
    /* one deadline object for all (the usual inf): tuples compare it by identity
     * first, so the ids alone give the same order, and a list of str sorts faster */
    ranked = same_ddl ? PyList_GetSlice(jobs, 0, n) : NULL;
    if (same_ddl ? (!ranked || PyList_Sort(ranked) < 0) : PyList_Sort(keyed) < 0)
        goto done;
    if (!same_ddl) {
        if (!(ranked = PyList_New(n)))
            goto done;
        for (Py_ssize_t k = 0; k < n; k++) {
            PyObject *jid = PyTuple_GET_ITEM(PyList_GET_ITEM(keyed, k), 1);
            Py_INCREF(jid);
            PyList_SET_ITEM(ranked, k, jid);
        }
    }
    chains = PyList_New(n);
    tables = PyList_New(n);
    ents = PyList_New(n);
    if (!chains || !tables || !ents)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *jid = PyList_GET_ITEM(ranked, k);
        PyObject *e = PyDict_GetItemWithError(entries, jid);
        if (!e)
            goto done;
        Py_INCREF(e);
        PyList_SET_ITEM(ents, k, e);
        PyObject *st = PyTuple_GET_ITEM(e, 0), *i = PyTuple_GET_ITEM(e, 1);
        PyObject *memo = PyObject_GetAttr(st, str_chains);
        if (!memo)
            goto done;
        PyObject *c = PyDict_Check(memo) ? PyDict_GetItemWithError(memo, i) : NULL;
        Py_XINCREF(c);
        Py_DECREF(memo);
        if (!c && PyErr_Occurred())
            goto done;
        if (c && PyObject_IsTrue(c) != 1) {
            Py_CLEAR(c);
            if (PyErr_Occurred())
                goto done;
        }
        if (!c && !(c = PyObject_CallFunctionObjArgs(chain_fn, st, i, NULL)))
            goto done;
        if (!PyTuple_Check(c) || PyTuple_GET_SIZE(c) < 2 || !PyTuple_Check(PyTuple_GET_ITEM(c, 1))) {
            Py_DECREF(c);
            out = not_implemented();
            goto done;
        }
        PyList_SET_ITEM(chains, k, c);
        /* the rows' bytes where the chain keeps them (the same numbers as its table) */
        PyObject *rows_of = PyTuple_GET_SIZE(c) > 2 && PyBytes_CheckExact(PyTuple_GET_ITEM(c, 2))
                                ? PyTuple_GET_ITEM(c, 2) : PyTuple_GET_ITEM(c, 0);
        Py_INCREF(rows_of);
        PyList_SET_ITEM(tables, k, rows_of);
    }
    cut = cut_tables(tables, free_in);
    if (!cut || cut == Py_NotImplemented) {
        out = cut;
        cut = NULL;
        goto done;
    }
    Py_ssize_t stop = PyLong_AsSsize_t(PyTuple_GET_ITEM(cut, 3));
    long long left = PyLong_AsLongLong(PyTuple_GET_ITEM(cut, 2));
    PyObject *took = PyTuple_GET_ITEM(cut, 1);
    if (PyErr_Occurred())
        goto done;
    heap = PyList_New(0);
    if (!heap)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *jid = PyList_GET_ITEM(ranked, k), *e = PyList_GET_ITEM(ents, k);
        PyObject *st = PyTuple_GET_ITEM(e, 0), *i = PyTuple_GET_ITEM(e, 1), *ddl = PyTuple_GET_ITEM(e, 2);
        Py_ssize_t t = PyLong_AsSsize_t(PyList_GET_ITEM(took, k));
        if (t == -1 && PyErr_Occurred())
            goto done;
        if (t) {  /* the level its chain reached: cur[jid] */
            PyObject *levels = PyTuple_GET_ITEM(PyList_GET_ITEM(chains, k), 1);
            if (t > PyTuple_GET_SIZE(levels)) {
                PyErr_SetString(PyExc_IndexError, "merge_open: a chain shorter than its rows");
                goto done;
            }
            i = PyTuple_GET_ITEM(levels, t - 1);
            if (PyDict_SetItem(cur, jid, i) < 0)
                goto done;
        }
        PyObject *ext_all = PyObject_GetAttr(st, str_ext);
        if (!ext_all)
            goto done;
        PyObject *ext = PyObject_GetItem(ext_all, i);
        Py_DECREF(ext_all);
        if (!ext)
            goto done;
        if (!PyTuple_Check(ext)) {
            Py_DECREF(ext);
            PyErr_SetString(PyExc_TypeError, "merge_open: Steps.ext rows must be tuples");
            goto done;
        }
        Py_ssize_t p = k == stop ? bisect_ints(ext, left) : PyTuple_GET_SIZE(ext);
        if (p < 0) {
            Py_DECREF(ext);
            PyErr_SetString(PyExc_OverflowError, "merge_open: a step's GPU count is not an int that fits a long");
            goto done;
        }
        int pays = 0;
        if (p) {
            int overflow = 0;
            long long first = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(ext, 0), &overflow);
            if (first == -1 && PyErr_Occurred()) {
                Py_DECREF(ext);
                goto done;
            }
            pays = !overflow && first <= left;
        }
        Py_DECREF(ext);
        if (!pays)
            continue;
        PyObject *gain_all = PyObject_GetAttr(st, str_gain), *to_all = PyObject_GetAttr(st, str_to);
        PyObject *gain = NULL, *to = NULL, *neg = NULL, *item = NULL;
        int ok = gain_all && to_all && (gain = PyObject_GetItem(gain_all, i)) && (to = PyObject_GetItem(to_all, i));
        if (ok) {
            PyObject *g = PySequence_GetItem(gain, p - 1), *lv = PySequence_GetItem(to, p - 1);
            if (g && lv && (neg = PyNumber_Negative(g)))
                item = PyTuple_Pack(4, neg, ddl, jid, lv);
            Py_XDECREF(g);
            Py_XDECREF(lv);
        }
        Py_XDECREF(gain_all);
        Py_XDECREF(to_all);
        Py_XDECREF(gain);
        Py_XDECREF(to);
        Py_XDECREF(neg);
        if (!item)
            goto done;
        int bad = PyList_Append(heap, item);
        Py_DECREF(item);
        if (bad < 0)
            goto done;
    }
    out = Py_BuildValue("LO", left, heap);
done:
    Py_XDECREF(keyed);
    Py_XDECREF(ranked);
    Py_XDECREF(chains);
    Py_XDECREF(tables);
    Py_XDECREF(ents);
    Py_XDECREF(cut);
    Py_XDECREF(heap);
    return out;
}

static PyObject *str_job_id, *str_deadline, *str_count_list;  /* interned, as the Steps names */

/* bisect.bisect_left (``right`` 0) or bisect_right (1) of ``x`` in the
 * tuple ``tup``, by Python's <; -1 with an error set. */
static Py_ssize_t
bisect_obj(PyObject *tup, PyObject *x, int right)
{
    Py_ssize_t lo = 0, hi = PyTuple_GET_SIZE(tup);
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        /* left: go right while item < x; right: go left while x < item */
        int lt = right ? PyObject_RichCompareBool(x, PyTuple_GET_ITEM(tup, mid), Py_LT)
                       : PyObject_RichCompareBool(PyTuple_GET_ITEM(tup, mid), x, Py_LT);
        if (lt < 0)
            return -1;
        if (lt == right)
            hi = mid;
        else
            lo = mid + 1;
    }
    return lo;
}

/* bisect_left(tup, x): in C on ints that fit a long long, else as
 * bisect_obj (the same probes either way); -1 with an error. */
static Py_ssize_t
bisect_ints_or_obj(PyObject *tup, PyObject *x)
{
    int overflow = 0;
    long long xv = PyLong_CheckExact(x) ? PyLong_AsLongLongAndOverflow(x, &overflow) : 0;
    Py_ssize_t at = PyLong_CheckExact(x) && !overflow
                        ? bisect_ints_in(&PyTuple_GET_ITEM(tup, 0), PyTuple_GET_SIZE(tup), xv, 0) : -2;
    return at == -2 ? bisect_obj(tup, x, 0) : at;
}

/* steps_input(jobs, levels, base, shares, weights, tables, make, inf): the
 * loop of elasticflow.algorithm2_input (Algorithm 2's input). Per job view (in
 * order): its levels, the step tables memoised in ``tables`` under (id of
 * the levels, GPUs held, started, share, weight) when they were made for
 * those very levels, else make(view, levels, share, weight); its starting
 * level (its base's place among the counts, 0 without a base) and its
 * deadline (``inf`` without one). NotImplemented for a view that is not a
 * tuple of the JobView fields. */
static PyObject *
steps_input(PyObject *self, PyObject *args)
{
    PyObject *jobs, *levels, *base, *shares, *weights, *tables, *make, *inf;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OO", &PyList_Type, &jobs, &PyDict_Type, &levels, &PyDict_Type, &base,
                          &PyDict_Type, &shares, &PyList_Type, &weights, &PyDict_Type, &tables, &make, &inf))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(jobs);
    if (PyList_GET_SIZE(weights) != n)
        return not_implemented();
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *j = PyList_GET_ITEM(jobs, k);
        if (!PyTuple_Check(j) || PyTuple_GET_SIZE(j) < 10 || !PyTuple_Check(PyTuple_GET_ITEM(j, 2)))
            return not_implemented();
    }
    PyObject *out = PyDict_New(), *zero = PyLong_FromLong(0);
    if (!out || !zero) {
        Py_XDECREF(out);
        Py_XDECREF(zero);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *j = PyList_GET_ITEM(jobs, k), *weight = PyList_GET_ITEM(weights, k);
        PyObject *spec = PyTuple_GET_ITEM(j, 0), *jid = NULL, *ddl = NULL, *key = NULL, *steps = NULL;
        PyObject *entry = NULL, *start = NULL, *id = NULL, *held = NULL, *started = NULL;
        int ok = 0;
        if (!(jid = PyObject_GetAttr(spec, str_job_id)))
            goto next;
        PyObject *lv = PyDict_GetItemWithError(levels, jid), *b = lv ? PyDict_GetItemWithError(base, jid) : NULL;
        if (!lv || !b) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, jid);
            goto next;
        }
        int has = PyDict_Contains(shares, jid);
        if (has < 0)
            goto next;
        PyObject *share = has ? b : Py_None;
        PyObject *executed = PyTuple_GET_ITEM(j, 5);
        int go = PyFloat_CheckExact(executed) ? PyFloat_AS_DOUBLE(executed) > 0.0
                                              : PyObject_RichCompareBool(executed, zero, Py_GT);  /* executed > 0 */
        if (go < 0 || !(id = PyLong_FromVoidPtr(lv))
            || !(held = PyLong_FromSsize_t(PyTuple_GET_SIZE(PyTuple_GET_ITEM(j, 2)))))
            goto next;
        started = go ? Py_True : Py_False;
        Py_INCREF(started);
        if (!(key = PyTuple_Pack(5, id, held, started, share, weight)))
            goto next;
        PyObject *hit = PyDict_GetItemWithError(tables, key);
        if (!hit && PyErr_Occurred())
            goto next;
        if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 2 && PyTuple_GET_ITEM(hit, 0) == lv) {
            steps = PyTuple_GET_ITEM(hit, 1);
            Py_INCREF(steps);
        } else if (!(steps = PyObject_CallFunctionObjArgs(make, j, lv, share, weight, NULL))) {
            goto next;
        }
        int has_b = PyObject_IsTrue(b);
        if (has_b < 0)
            goto next;
        if (has_b) {
            PyObject *counts = PyObject_GetAttr(lv, str_count_list);
            if (!counts)
                goto next;
            Py_ssize_t at = PyTuple_Check(counts) ? bisect_ints_or_obj(counts, b) : -2;
            Py_DECREF(counts);
            if (at == -2)
                PyErr_SetString(PyExc_TypeError, "steps_input: Levels.count_list must be a tuple");
            if (at < 0)
                goto next;
            start = PyLong_FromSsize_t(at);
        } else {
            start = zero;
            Py_INCREF(start);
        }
        if (!start || !(ddl = PyObject_GetAttr(spec, str_deadline)))
            goto next;
        if (!(entry = PyTuple_Pack(3, steps, start, ddl == Py_None ? inf : ddl)))
            goto next;
        ok = PyDict_SetItem(out, jid, entry) == 0;
    next:
        Py_XDECREF(jid);
        Py_XDECREF(ddl);
        Py_XDECREF(key);
        Py_XDECREF(steps);
        Py_XDECREF(entry);
        Py_XDECREF(start);
        Py_XDECREF(id);
        Py_XDECREF(held);
        Py_XDECREF(started);
        if (!ok) {
            Py_DECREF(out);
            Py_DECREF(zero);
            return NULL;
        }
    }
    Py_DECREF(zero);
    return out;
}

static PyObject *str_lead, *str_end;  /* interned */

/* A small int of a tuple's item ``k`` into *out; -1 with an error set. */
static int
int_item(PyObject *tup, Py_ssize_t k, long long *out)
{
    int overflow = 0;
    if (!PyTuple_Check(tup) || PyTuple_GET_SIZE(tup) <= k) {
        PyErr_SetString(PyExc_TypeError, "expected a tuple of ints");
        return -1;
    }
    *out = PyLong_AsLongLongAndOverflow(PyTuple_GET_ITEM(tup, k), &overflow);
    if (*out == -1 && PyErr_Occurred())
        return -1;
    if (overflow) {
        PyErr_SetString(PyExc_OverflowError, "a GPU count too large for a long");
        return -1;
    }
    return 0;
}

/* greedy_open(entries, free): the opening of tidal.scheduler.greedy.greedy.
 * Returns (binds, jobs with a chain, their largest first need, levels): when
 * the GPUs left never bind, ``binds`` is False and each job's level is the
 * end of its chain; otherwise each job's level is its starting one. */
static PyObject *
greedy_open(PyObject *self, PyObject *args)
{
    PyObject *entries;
    long long free_in;
    if (!PyArg_ParseTuple(args, "O!L", &PyDict_Type, &entries, &free_in))
        return NULL;
    PyObject *jobs = PyList_New(0), *cur = PyDict_New(), *key, *e, *out = NULL;
    Py_ssize_t pos = 0;
    long long total = 0, need = 0, need0 = 0;
    if (!jobs || !cur)
        goto done;
    while (PyDict_Next(entries, &pos, &key, &e)) {
        if (!PyTuple_Check(e) || PyTuple_GET_SIZE(e) != 3) {
            PyErr_SetString(PyExc_TypeError, "greedy_open: entries must be (steps, level, deadline)");
            goto done;
        }
        PyObject *st = PyTuple_GET_ITEM(e, 0), *i = PyTuple_GET_ITEM(e, 1);
        if (PyDict_SetItem(cur, key, i) < 0)
            goto done;
        PyObject *leads = PyObject_GetAttr(st, str_lead);
        if (!leads)
            goto done;
        PyObject *lead = PyObject_GetItem(leads, i);
        Py_DECREF(leads);
        if (!lead)
            goto done;
        if (lead != Py_None) {
            long long a, b, c;
            int bad = int_item(lead, 0, &a) < 0 || int_item(lead, 1, &b) < 0 || int_item(lead, 2, &c) < 0
                      || PyList_Append(jobs, key) < 0;
            Py_DECREF(lead);
            if (bad)
                goto done;
            total += a;
            if (b > need)
                need = b;
            if (c > need0)
                need0 = c;
        } else {
            Py_DECREF(lead);
        }
    }
    int binds = !(free_in - total >= need);
    if (!binds) {  /* every job at the end of its chain */
        for (Py_ssize_t k = 0; k < PyList_GET_SIZE(jobs); k++) {
            PyObject *jid = PyList_GET_ITEM(jobs, k), *en = PyDict_GetItemWithError(entries, jid);
            if (!en)
                goto done;
            PyObject *ends = PyObject_GetAttr(PyTuple_GET_ITEM(en, 0), str_end);
            if (!ends)
                goto done;
            PyObject *lv = PyObject_GetItem(ends, PyTuple_GET_ITEM(en, 1));
            Py_DECREF(ends);
            if (!lv)
                goto done;
            int bad = PyDict_SetItem(cur, jid, lv) < 0;
            Py_DECREF(lv);
            if (bad)
                goto done;
        }
    }
    out = Py_BuildValue("OOLO", binds ? Py_True : Py_False, jobs, need0, cur);
done:
    Py_XDECREF(jobs);
    Py_XDECREF(cur);
    return out;
}

/* levels_of(jobs, by_job, make): the loop of elasticflow's _Memo.levels_of.
 * Per job view of the iterable ``jobs`` (in order): the levels kept in
 * ``by_job`` (job id -> (spec, batch, levels)) when made for the view's very
 * spec and an equal batch, else make(view), kept there; a new dict job id ->
 * levels. NotImplemented (nothing changed) for a view that is not a tuple of
 * the JobView fields. */
static PyObject *
levels_of(PyObject *self, PyObject *args)
{
    PyObject *jobs_in, *by_job, *make;
    if (!PyArg_ParseTuple(args, "OO!O", &jobs_in, &PyDict_Type, &by_job, &make))
        return NULL;
    PyObject *jobs = PySequence_Fast(jobs_in, "levels_of: jobs must be iterable");
    if (!jobs)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(jobs);
    PyObject **items = PySequence_Fast_ITEMS(jobs);
    for (Py_ssize_t k = 0; k < n; k++) {
        if (!PyTuple_Check(items[k]) || PyTuple_GET_SIZE(items[k]) < 10) {
            Py_DECREF(jobs);
            return not_implemented();
        }
    }
    PyObject *out = PyDict_New();
    if (!out) {
        Py_DECREF(jobs);
        return NULL;
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *j = items[k], *spec = PyTuple_GET_ITEM(j, 0), *batch = PyTuple_GET_ITEM(j, 9);
        PyObject *jid = PyObject_GetAttr(spec, str_job_id), *made = NULL, *lv;
        if (!jid)
            goto fail;
        PyObject *hit = PyDict_GetItemWithError(by_job, jid);
        if (!hit && PyErr_Occurred())
            goto fail_jid;
        int same = 0;
        if (hit && PyTuple_Check(hit) && PyTuple_GET_SIZE(hit) == 3 && PyTuple_GET_ITEM(hit, 0) == spec) {
            int ne = PyObject_RichCompareBool(PyTuple_GET_ITEM(hit, 1), batch, Py_NE);
            if (ne < 0)
                goto fail_jid;
            same = !ne;
        }
        if (same) {
            lv = PyTuple_GET_ITEM(hit, 2);
        } else {
            if (!(lv = PyObject_CallFunctionObjArgs(make, j, NULL)))
                goto fail_jid;
            made = PyTuple_Pack(3, spec, batch, lv);
            Py_DECREF(lv);
            if (!made || PyDict_SetItem(by_job, jid, made) < 0) {
                Py_XDECREF(made);
                goto fail_jid;
            }
            lv = PyTuple_GET_ITEM(made, 2);
        }
        int bad = PyDict_SetItem(out, jid, lv) < 0;
        Py_XDECREF(made);
        Py_DECREF(jid);
        if (bad)
            goto fail;
        continue;
    fail_jid:
        Py_DECREF(jid);
    fail:
        Py_DECREF(out);
        Py_DECREF(jobs);
        return NULL;
    }
    Py_DECREF(jobs);
    return out;
}

static PyObject *str_ef_class, *str_tiresias_base, *str_holds_gpus, *str_submit_time;  /* interned */

/* Whether every item of the tuple is a float. */
static int
all_floats(PyObject *tup)
{
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(tup); k++)
        if (!PyFloat_CheckExact(PyTuple_GET_ITEM(tup, k)))
            return 0;
    return 1;
}

/* Appends x to the list ``to``; 0, or -1 with an error. */
static int
append_float(PyObject *to, double x)
{
    PyObject *f = PyFloat_FromDouble(x);
    int rc = f ? PyList_Append(to, f) : -1;
    Py_XDECREF(f);
    return rc;
}

/* A best-effort job's place in the floors' order: (queue, not holding GPUs,
 * submit time, id), compared in C when the submit time is a float (not NaN)
 * and the id a str, as Python compares the tuple. */
typedef struct {
    Py_ssize_t q;
    int idle;
    double submit;
    PyObject *submit_obj, *jid;  /* owned */
} floor_key;

static int
floor_key_cmp(const void *pa, const void *pb)
{
    const floor_key *a = pa, *b = pb;
    if (a->q != b->q)
        return a->q < b->q ? -1 : 1;
    if (a->idle != b->idle)
        return a->idle < b->idle ? -1 : 1;
    if (a->submit != b->submit)
        return a->submit < b->submit ? -1 : 1;
    return PyUnicode_Compare(a->jid, b->jid);  /* exact strs: cannot fail */
}

/* The pass over one job of las_floors' first loop: a best-effort job's key
 * goes to keys[*nkeys] (*plain stays 1 while every key can be compared in
 * C); 0, or -1 with an error. */
static int
floor_first(PyObject *j, PyObject *base, PyObject *split, PyObject *th, PyObject *queues, PyObject *classes,
            PyObject *zero, PyObject *fzero, floor_key *keys, Py_ssize_t *nkeys, int *plain, PyObject **free,
            PyObject *weights)
{
    PyObject *spec = PyTuple_GET_ITEM(j, 0), *tags = PyTuple_GET_ITEM(j, 8);
    PyObject *jid = PyObject_GetAttr(spec, str_job_id), *ddl = NULL, *x = NULL, *q = NULL, *hg = NULL;
    int rc = -1;
    if (!jid || !(ddl = PyObject_GetAttr(spec, str_deadline)))
        goto out;
    int be = ddl == Py_None;
    if (!be) {
        PyObject *cls = PyDict_GetItemWithError(tags, str_ef_class);
        if (!cls && PyErr_Occurred())
            goto out;
        if (cls && (be = PySequence_Contains(classes, cls)) < 0)
            goto out;
    }
    if (be) {  /* a best-effort job: its LAS queue, and its place in the floors' order */
        PyObject *b0 = PyDict_GetItemWithError(tags, str_tiresias_base);
        if (!b0 && PyErr_Occurred())
            goto out;
        PyObject *att = PyTuple_GET_ITEM(j, 4);
        b0 = b0 ? b0 : fzero;
        Py_ssize_t at;
        if (PyFloat_CheckExact(att) && PyFloat_CheckExact(b0) && all_floats(th)) {  /* in C, as Python would */
            double xv = PyFloat_AS_DOUBLE(att) - PyFloat_AS_DOUBLE(b0);
            Py_ssize_t lo = 0, hi = PyTuple_GET_SIZE(th);
            while (lo < hi) {  /* bisect_right */
                Py_ssize_t mid = (lo + hi) / 2;
                if (xv < PyFloat_AS_DOUBLE(PyTuple_GET_ITEM(th, mid)))
                    hi = mid;
                else
                    lo = mid + 1;
            }
            at = lo;
        } else if (!(x = PyNumber_Subtract(att, b0)) || (at = bisect_obj(th, x, 1)) < 0) {
            goto out;
        }
        if (!(q = PyLong_FromSsize_t(at)) || PyDict_SetItem(queues, jid, q) < 0)
            goto out;
        if (append_float(weights, ldexp(1.0, (int)-at)) < 0)  /* its weight 2 ** -queue, exact */
            goto out;
        if (!(hg = PyObject_GetAttr(PyTuple_GET_ITEM(j, 1), str_holds_gpus)))
            goto out;
        int holds = PyObject_IsTrue(hg);
        PyObject *submit;
        if (holds < 0 || !(submit = PyObject_GetAttr(spec, str_submit_time)))
            goto out;
        floor_key *k = &keys[(*nkeys)++];
        k->q = at;
        k->idle = !holds;
        k->submit_obj = submit;
        k->jid = jid;
        Py_INCREF(jid);
        if (!PyFloat_CheckExact(submit) || !PyUnicode_CheckExact(jid) || isnan(PyFloat_AS_DOUBLE(submit)))
            *plain = 0;
        else
            k->submit = PyFloat_AS_DOUBLE(submit);
    } else {  /* a guaranteed job keeps what the split gave it */
        PyObject *n = PyDict_GetItemWithError(split, jid), *b;
        if (!n && PyErr_Occurred())
            goto out;
        if (append_float(weights, 1.0) < 0)
            goto out;
        if (!(b = PyDict_GetItemWithError(base, jid)) && PyErr_Occurred())
            goto out;
        n = n ? n : zero;
        b = b ? b : zero;
        int more = PyObject_RichCompareBool(n, b, Py_GT);
        if (more < 0)
            goto out;
        if (more) {
            PyObject *d = PyNumber_Subtract(n, b), *f = d ? PyNumber_Subtract(*free, d) : NULL;
            Py_XDECREF(d);
            if (!f)
                goto out;
            Py_SETREF(*free, f);
            if (PyDict_SetItem(base, jid, n) < 0)
                goto out;
        }
    }
    rc = 0;
out:
    Py_XDECREF(jid);
    Py_XDECREF(ddl);
    Py_XDECREF(x);
    Py_XDECREF(q);
    Py_XDECREF(hg);
    return rc;
}

/* Sorts keys[0:n] in the floors' order: in C when every key allows it, else
 * as Python sorts the tuples; 0, or -1 with an error. */
static int
floor_sort(floor_key *keys, Py_ssize_t n, int plain)
{
    if (plain) {
        qsort(keys, (size_t)n, sizeof(floor_key), floor_key_cmp);  /* ids are unique: a total order */
        return 0;
    }
    PyObject *keyed = PyList_New(n);
    if (!keyed)
        return -1;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *item = Py_BuildValue("(nOOO)", keys[k].q, keys[k].idle ? Py_True : Py_False, keys[k].submit_obj,
                                       keys[k].jid);
        if (!item) {
            Py_DECREF(keyed);
            return -1;
        }
        PyList_SET_ITEM(keyed, k, item);
    }
    if (PyList_Sort(keyed) < 0) {  /* ids are unique: the first four fields decide */
        Py_DECREF(keyed);
        return -1;
    }
    for (Py_ssize_t k = 0; k < n; k++) {  /* only the ids are read after the sort */
        PyObject *jid = PyTuple_GET_ITEM(PyList_GET_ITEM(keyed, k), 3);
        Py_INCREF(jid);
        Py_SETREF(keys[k].jid, jid);
    }
    Py_DECREF(keyed);
    return 0;
}

/* The floors' second loop for job ``jid``: its smallest count if nothing is
 * in its base yet and it fits in *free; 0, or -1 with an error. */
static int
floor_second(PyObject *jid, PyObject *base, PyObject *levels, PyObject *zero, PyObject **free)
{
    PyObject *b = PyDict_GetItemWithError(base, jid);
    if (!b && PyErr_Occurred())
        return -1;
    int has = b ? PyObject_IsTrue(b) : 0;
    if (has)
        return has < 0 ? -1 : 0;
    PyObject *lv = PyDict_GetItemWithError(levels, jid);
    if (!lv) {
        if (!PyErr_Occurred())
            PyErr_SetObject(PyExc_KeyError, jid);
        return -1;
    }
    PyObject *counts = PyObject_GetAttr(lv, str_count_list), *smallest = zero;
    if (!counts)
        return -1;
    if (!PyTuple_Check(counts)) {
        Py_DECREF(counts);
        PyErr_SetString(PyExc_TypeError, "las_floors: Levels.count_list must be a tuple");
        return -1;
    }
    Py_ssize_t m = PyTuple_GET_SIZE(counts);
    int pos = m > 1 ? PyObject_RichCompareBool(PyTuple_GET_ITEM(counts, 1), zero, Py_GT) : 0;
    if (pos < 0)
        goto fail;
    if (pos) {
        smallest = PyTuple_GET_ITEM(counts, 1);
    } else {
        for (Py_ssize_t k = 0; k < m; k++) {
            int p = PyObject_RichCompareBool(PyTuple_GET_ITEM(counts, k), zero, Py_GT);
            if (p < 0)
                goto fail;
            if (p) {
                smallest = PyTuple_GET_ITEM(counts, k);
                break;
            }
        }
    }
    int fits = PyObject_RichCompareBool(zero, smallest, Py_LT);
    if (fits > 0)
        fits = PyObject_RichCompareBool(smallest, *free, Py_LE);
    if (fits < 0)
        goto fail;
    if (fits) {
        PyObject *f = PyNumber_Subtract(*free, smallest);
        if (!f || PyDict_SetItem(base, jid, smallest) < 0) {
            Py_XDECREF(f);
            goto fail;
        }
        Py_SETREF(*free, f);
    }
    Py_DECREF(counts);
    return 0;
fail:
    Py_DECREF(counts);
    return -1;
}

/* las_floors(jobs, base, split, levels, thresholds, queues, free, classes,
 * weights): the loops of Tidal._floors; returns the GPUs still free, and
 * appends each job's weight in Algorithm 2 to ``weights`` (Tidal._weights:
 * 1.0 for a guaranteed job, 2 ** -queue for a best-effort one).
 * NotImplemented (nothing changed) for a view that is not a tuple of the
 * JobView fields with dict tags. */
static PyObject *
las_floors(PyObject *self, PyObject *args)
{
    PyObject *jobs, *base, *split, *levels, *th, *queues, *free_in, *classes, *weights;
    if (!PyArg_ParseTuple(args, "O!O!O!O!O!O!OOO!", &PyList_Type, &jobs, &PyDict_Type, &base, &PyDict_Type, &split,
                          &PyDict_Type, &levels, &PyTuple_Type, &th, &PyDict_Type, &queues, &free_in, &classes,
                          &PyList_Type, &weights))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(jobs), nkeys = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *j = PyList_GET_ITEM(jobs, k);
        if (!PyTuple_Check(j) || PyTuple_GET_SIZE(j) < 10 || !PyDict_Check(PyTuple_GET_ITEM(j, 8)))
            return not_implemented();
    }
    PyObject *zero = PyLong_FromLong(0), *fzero = PyFloat_FromDouble(0.0), *free = free_in;
    floor_key *keys = PyMem_Malloc(sizeof(floor_key) * (size_t)(n ? n : 1));
    int plain = 1;
    Py_INCREF(free);
    if (!keys) {
        PyErr_NoMemory();
        goto fail;
    }
    if (!zero || !fzero)
        goto fail;
    for (Py_ssize_t k = 0; k < n; k++)
        if (floor_first(PyList_GET_ITEM(jobs, k), base, split, th, queues, classes, zero, fzero, keys, &nkeys,
                        &plain, &free, weights) < 0)
            goto fail;
    if (floor_sort(keys, nkeys, plain) < 0)
        goto fail;
    for (Py_ssize_t k = 0; k < nkeys; k++)
        if (floor_second(keys[k].jid, base, levels, zero, &free) < 0)
            goto fail;
    goto done;
fail:
    Py_CLEAR(free);
done:
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        Py_DECREF(keys[k].jid);
        Py_DECREF(keys[k].submit_obj);
    }
    PyMem_Free(keys);
    Py_XDECREF(zero);
    Py_XDECREF(fzero);
    return free;
}

/* Whether the count ``n`` equals len(gpus) (the pair (job, n) is among the
 * items of the job -> len(GPUs) dict); -1 with an error set. */
static int
same_count(PyObject *n, PyObject *gpus)
{
    Py_ssize_t held = PyObject_Size(gpus);
    PyObject *h = held >= 0 ? PyLong_FromSsize_t(held) : NULL;
    int same = h ? PyObject_RichCompareBool(n, h, Py_EQ) : -1;
    Py_XDECREF(h);
    return same;
}

/* placer_start(current, want, mask): the start of the buddy placer
 * (_Placer): the jobs of ``current`` (job -> GPUs) whose count ``want``
 * keeps keep their GPUs (a new dict, in the order of ``current``); the
 * others' GPUs are cleared in the bool ``mask`` unless it is None; returns
 * (keep, the jobs of ``want`` whose count is not what they hold, in the
 * order of ``want``). NotImplemented for GPUs outside the mask or not ints. */
static PyObject *
placer_start(PyObject *self, PyObject *args)
{
    PyObject *current, *want, *mask_obj;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyDict_Type, &current, &PyDict_Type, &want, &mask_obj))
        return NULL;
    Py_buffer mv;
    int have_mask = mask_obj != Py_None;
    if (have_mask && get_bool(mask_obj, &mv, 1) < 0)
        return not_implemented();
    unsigned char *mask = have_mask ? (unsigned char *)mv.buf : NULL;
    Py_ssize_t size = have_mask ? mv.shape[0] : 0, pos = 0;
    PyObject *keep = PyDict_New(), *todo = PyList_New(0), *jid, *val, *out = NULL;
    if (!keep || !todo)
        goto done;
    while (PyDict_Next(current, &pos, &jid, &val)) {
        PyObject *w = PyDict_GetItemWithError(want, jid);
        if (!w && PyErr_Occurred())
            goto done;
        int same = w ? same_count(w, val) : 0;
        if (same < 0)
            goto done;
        if (same) {
            if (PyDict_SetItem(keep, jid, val) < 0)
                goto done;
        } else if (have_mask) {  /* its count changes: its GPUs are free to place */
            PyObject *seq = PySequence_Fast(val, "placer_start: GPUs must be a sequence");
            if (!seq)
                goto done;
            for (Py_ssize_t k = 0; k < PySequence_Fast_GET_SIZE(seq); k++) {
                PyObject *g = PySequence_Fast_GET_ITEM(seq, k);
                Py_ssize_t gi = PyLong_Check(g) ? PyLong_AsSsize_t(g) : -1;
                if (gi < 0 || gi >= size) {
                    PyErr_Clear();
                    Py_DECREF(seq);
                    out = not_implemented();
                    goto done;
                }
                mask[gi] = 0;
            }
            Py_DECREF(seq);
        }
    }
    pos = 0;
    while (PyDict_Next(want, &pos, &jid, &val)) {
        PyObject *have = PyDict_GetItemWithError(current, jid);
        if (!have && PyErr_Occurred())
            goto done;
        int same = have ? same_count(val, have) : 0;
        if (same < 0)
            goto done;
        if (!same && PyList_Append(todo, jid) < 0)
            goto done;
    }
    out = PyTuple_Pack(2, keep, todo);
done:
    Py_XDECREF(keep);
    Py_XDECREF(todo);
    if (have_mask)
        PyBuffer_Release(&mv);
    return out;
}

/* row_views(cls, cols, counters): the running rows' ids and views
 * (tidal.sim.runset.Rows.columns): per row with an id, cls made as
 * tuple.__new__(cls, (spec, state, gpus, done, attained, executed, since,
 * admitted, tags, batch)) from the 8 column lists (id, spec, state, gpus,
 * since, admitted, tags, batch) and the rows' (done, attained, executed)
 * float64 array. NotImplemented for any other shape or type. */
static PyObject *
row_views(PyObject *self, PyObject *args)
{
    PyObject *cls_obj, *cols;
    PyObject *counters;
    if (!PyArg_ParseTuple(args, "O!O!O", &PyType_Type, &cls_obj, &PyList_Type, &cols, &counters))
        return NULL;
    PyTypeObject *cls = (PyTypeObject *)cls_obj;
    if (!PyType_IsSubtype(cls, &PyTuple_Type) || PyList_GET_SIZE(cols) != 8)
        return not_implemented();
    Py_ssize_t n = -1;
    for (int c = 0; c < 8; c++) {
        PyObject *col = PyList_GET_ITEM(cols, c);
        if (!PyList_Check(col) || (n >= 0 && PyList_GET_SIZE(col) != n))
            return not_implemented();
        n = PyList_GET_SIZE(col);
    }
    Py_buffer view;
    if (get_f64(counters, &view, 2, 3, 0) < 0)
        return not_implemented();
    if (view.shape[0] != n) {
        PyBuffer_Release(&view);
        return not_implemented();
    }
    const double *cnt = view.buf;
    PyObject **col[8];
    for (int c = 0; c < 8; c++)
        col[c] = ((PyListObject *)PyList_GET_ITEM(cols, c))->ob_item;
    PyObject *ids = PyList_New(0), *views = PyList_New(0), *out = NULL;
    if (!ids || !views)
        goto done;
    for (Py_ssize_t r = 0; r < n; r++) {
        if (col[0][r] == Py_None)
            continue;  /* a hole */
        PyObject *v = cls->tp_alloc(cls, 10);
        if (!v)
            goto done;
        PyObject *items[10] = {col[1][r], col[2][r], col[3][r], NULL, NULL, NULL, col[4][r], col[5][r],
                               col[6][r], col[7][r]};
        for (int k = 0; k < 10; k++) {
            PyObject *x = items[k];
            if (x)
                Py_INCREF(x);
            else if (!(x = PyFloat_FromDouble(cnt[3 * r + (k - 3)]))) {
                Py_DECREF(v);
                goto done;
            }
            PyTuple_SET_ITEM(v, k, x);
        }
        int bad = PyList_Append(views, v) < 0 || PyList_Append(ids, col[0][r]) < 0;
        Py_DECREF(v);
        if (bad)
            goto done;
    }
    out = PyTuple_Pack(2, ids, views);
done:
    PyBuffer_Release(&view);
    Py_XDECREF(ids);
    Py_XDECREF(views);
    return out;
}

/* Node ``node`` went from ``old`` free GPUs to ``new``: it moves from
 * by_free[old] (deleted at its bisect_left place) to by_free[new] (inserted
 * in order), as ViewCache._rebucket; 0, or -1 with an error. */
static int
rebucket(PyObject *by_free, PyObject *node_obj, Py_ssize_t node, Py_ssize_t old, Py_ssize_t new)
{
    PyObject *from = PyList_GET_ITEM(by_free, old), *to = PyList_GET_ITEM(by_free, new);
    Py_ssize_t i = bisect_ints_in(((PyListObject *)from)->ob_item, PyList_GET_SIZE(from), node, 0);
    if (i >= PyList_GET_SIZE(from)) {
        PyErr_SetString(PyExc_IndexError, "list assignment index out of range");
        return -1;
    }
    if (i < 0 || PyList_SetSlice(from, i, i + 1, NULL) < 0 ||
        (i = bisect_ints_in(((PyListObject *)to)->ob_item, PyList_GET_SIZE(to), node, 0)) < 0) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_TypeError, "gpus_change: a node bucket holds something other than ints");
        return -1;
    }
    return PyList_Insert(to, i, node_obj);
}

/* gpus_change(gpus, jid, owner, used, node_of, free, node_gpus, by_free):
 * ViewCache's bookkeeping when a job takes ``gpus`` (``jid``: it becomes
 * their owner, and used) or gives them back (``jid`` None: they leave
 * ``owner``; KeyError for one it does not hold): the owners, the used mask
 * (None: not kept), and each of their nodes' free GPUs (``free[node]``, the
 * node's GPUs in order less those owned) and place among the nodes by free
 * count (``by_free``). NotImplemented, before any change, for another shape
 * or type. */
static PyObject *
gpus_change(PyObject *self, PyObject *args)
{
    PyObject *gpus, *jid, *owner, *used, *node_of, *free, *node_gpus, *by_free;
    if (!PyArg_ParseTuple(args, "O!OO!OO!O!O!O!", &PyTuple_Type, &gpus, &jid, &PyDict_Type, &owner, &used,
                          &PyTuple_Type, &node_of, &PyList_Type, &free, &PyList_Type, &node_gpus, &PyList_Type,
                          &by_free))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(gpus), size = PyTuple_GET_SIZE(node_of), nodes = PyList_GET_SIZE(free);
    Py_ssize_t nb = PyList_GET_SIZE(by_free), nn = 0;
    PyObject *out = NULL;  /* None when done, NotImplemented, or NULL with an error */
    if (n == 0 || n > 4096 || PyList_GET_SIZE(node_gpus) != nodes)
        return not_implemented();
    Py_ssize_t seen[4096];  /* the distinct nodes, in first-seen order */
    Py_buffer uv;
    int have_used = used != Py_None;
    if (have_used) {
        if (get_bool(used, &uv, 1) < 0)
            return not_implemented();
        if (uv.shape[0] != size) {
            PyBuffer_Release(&uv);
            return not_implemented();
        }
    }
    for (Py_ssize_t k = 0; k < n; k++) {  /* every check before any change */
        PyObject *g = PyTuple_GET_ITEM(gpus, k);
        Py_ssize_t gi = PyLong_CheckExact(g) ? PyLong_AsSsize_t(g) : -1, node;
        if (gi < 0 || gi >= size || !PyLong_CheckExact(PyTuple_GET_ITEM(node_of, gi)))
            goto skip;
        node = PyLong_AsSsize_t(PyTuple_GET_ITEM(node_of, gi));
        if (node < 0 || node >= nodes || !PyTuple_Check(PyList_GET_ITEM(free, node)) ||
            PyTuple_GET_SIZE(PyList_GET_ITEM(free, node)) >= nb ||
            !PyTuple_Check(PyList_GET_ITEM(node_gpus, node)) || PyTuple_GET_SIZE(PyList_GET_ITEM(node_gpus, node)) >= nb ||
            PyTuple_GET_SIZE(PyList_GET_ITEM(node_gpus, node)) > 64)
            goto skip;
        Py_ssize_t j = 0;
        while (j < nn && seen[j] != node)
            j++;
        if (j == nn)
            seen[nn++] = node;
    }
    for (Py_ssize_t b = 0; b < nb; b++)
        if (!PyList_Check(PyList_GET_ITEM(by_free, b)))
            goto skip;
    for (Py_ssize_t k = 0; k < n; k++) {  /* the owners, and the mask */
        PyObject *g = PyTuple_GET_ITEM(gpus, k);
        if ((jid != Py_None ? PyDict_SetItem(owner, g, jid) : PyDict_DelItem(owner, g)) < 0)
            goto done;
        if (have_used)
            ((char *)uv.buf)[PyLong_AsSsize_t(g)] = jid != Py_None;
    }
    for (Py_ssize_t j = 0; j < nn; j++) {  /* each node's free GPUs, and its bucket */
        PyObject *all = PyList_GET_ITEM(node_gpus, seen[j]);
        Py_ssize_t m = PyTuple_GET_SIZE(all), k2 = 0;
        PyObject *kept[64], *tup;  /* m <= 64, checked above */
        for (Py_ssize_t k = 0; k < m; k++) {
            PyObject *g = PyTuple_GET_ITEM(all, k);
            Py_ssize_t gi = have_used && PyLong_CheckExact(g) ? PyLong_AsSsize_t(g) : -1;
            if (gi == -1 && PyErr_Occurred())
                PyErr_Clear();  /* too large for the mask: the owners tell */
            /* the mask, where kept, says what the owners say */
            int held = gi >= 0 && gi < size ? ((char *)uv.buf)[gi] != 0 : PyDict_Contains(owner, g);
            if (held < 0)
                goto done;
            if (!held)
                kept[k2++] = g;
        }
        if (!(tup = PyTuple_New(k2)))
            goto done;
        for (Py_ssize_t k = 0; k < k2; k++) {
            Py_INCREF(kept[k]);
            PyTuple_SET_ITEM(tup, k, kept[k]);
        }
        Py_ssize_t old = PyTuple_GET_SIZE(PyList_GET_ITEM(free, seen[j]));
        PyObject *node_obj = PyLong_FromSsize_t(seen[j]);
        int bad = !node_obj || (k2 != old && rebucket(by_free, node_obj, seen[j], old, k2) < 0);
        Py_XDECREF(node_obj);
        if (bad) {
            Py_DECREF(tup);
            goto done;
        }
        PyList_SetItem(free, seen[j], tup);  /* steals tup */
    }
    out = Py_None;
    Py_INCREF(out);
    goto done;
skip:
    out = not_implemented();
done:
    if (have_used)
        PyBuffer_Release(&uv);
    return out;
}

/* changed_jobs(alloc, placement, held): the set of the jobs of ``alloc``
 * (job -> count) whose placement (``()`` if none) is not the very object
 * they hold (None if none), or whose placement's length is not their count
 * (record_rescales' first look). NotImplemented for a count that is not an
 * int or a placement that is not a tuple. */
static PyObject *
changed_jobs(PyObject *self, PyObject *args)
{
    PyObject *alloc, *placement, *held;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyDict_Type, &alloc, &PyDict_Type, &placement, &PyDict_Type, &held))
        return NULL;
    PyObject *jid, *n, *out = PySet_New(NULL), *empty = PyTuple_New(0);  /* the () that placement.get gives */
    Py_ssize_t pos = 0;
    if (!out || !empty)
        goto fail;
    while (PyDict_Next(alloc, &pos, &jid, &n)) {
        PyObject *p = PyDict_GetItemWithError(placement, jid), *h;
        if (!p && PyErr_Occurred())
            goto fail;
        if (!(h = PyDict_GetItemWithError(held, jid)) && PyErr_Occurred())
            goto fail;
        p = p ? p : empty;
        if (!PyLong_CheckExact(n) || !PyTuple_CheckExact(p)) {
            Py_DECREF(out);
            Py_DECREF(empty);
            return not_implemented();
        }
        Py_ssize_t count = PyLong_AsSsize_t(n);
        if (count == -1 && PyErr_Occurred())
            goto fail;
        if ((p != (h ? h : Py_None) || PyTuple_GET_SIZE(p) != count) && PySet_Add(out, jid) < 0)
            goto fail;
    }
    Py_DECREF(empty);
    return out;
fail:
    Py_XDECREF(out);
    Py_XDECREF(empty);
    return NULL;
}

/* advance_rows(S, M, L, n, now, useful): RunSet.advance's arithmetic on its
 * first n rows: S += M * (now - L) row by row (the product rounded, then
 * added, as numpy does), L = now. Returns ``useful`` plus the rows' last
 * gain column summed in row order (as cumsum), or with ``useful`` None the
 * list of those gains. NotImplemented for other arrays. */
static PyObject *
advance_rows(PyObject *self, PyObject *args)
{
    PyObject *s_obj, *m_obj, *l_obj, *useful;
    Py_ssize_t n;
    double now;
    if (!PyArg_ParseTuple(args, "OOOndO", &s_obj, &m_obj, &l_obj, &n, &now, &useful))
        return NULL;
    if (useful != Py_None && !PyFloat_CheckExact(useful))
        return not_implemented();
    Py_buffer sv, mv, lv;
    if (get_f64(s_obj, &sv, 2, 6, 1) < 0)
        return not_implemented();
    if (get_f64(m_obj, &mv, 2, 6, 0) < 0) {
        PyBuffer_Release(&sv);
        return not_implemented();
    }
    if (get_f64(l_obj, &lv, 1, 0, 1) < 0) {
        PyBuffer_Release(&sv);
        PyBuffer_Release(&mv);
        return not_implemented();
    }
    PyObject *out = NULL;
    if (n < 0 || n > sv.shape[0] || n > mv.shape[0] || n > lv.shape[0] || n == 0) {
        out = not_implemented();
        goto done;
    }
    double *S = sv.buf, *L = lv.buf, u = useful == Py_None ? 0.0 : PyFloat_AS_DOUBLE(useful);
    const double *M = mv.buf;
    PyObject *terms = useful == Py_None ? PyList_New(n) : NULL;
    if (useful == Py_None && !terms)
        goto done;
    for (Py_ssize_t r = 0; r < n; r++) {
        double dt = now - L[r], g = 0.0;
        for (int c = 0; c < 6; c++) {
            g = M[6 * r + c] * dt;
            S[6 * r + c] += g;
        }
        L[r] = now;
        if (terms) {
            PyObject *x = PyFloat_FromDouble(g);
            if (!x) {
                Py_DECREF(terms);
                goto done;
            }
            PyList_SET_ITEM(terms, r, x);
        } else {
            u = r ? u + g : g + u;
        }
    }
    out = terms ? terms : PyFloat_FromDouble(u);
done:
    PyBuffer_Release(&sv);
    PyBuffer_Release(&mv);
    PyBuffer_Release(&lv);
    return out;
}

/* runnable(jobs, ids, admit, drop, levels, shares): _Context.runnable's
 * loop over api.schedulable: of the job views (tuples of the JobView
 * fields) admitted before (``admitted`` true) or in ``admit``, and not in
 * ``drop`` (``ids``: their ids, in order), those whose levels have a count
 * above 0, and a dict of their share (0 without one). NotImplemented for a
 * view that is not such a tuple or sequences of other lengths. */
static PyObject *
runnable(PyObject *self, PyObject *args)
{
    PyObject *jobs, *ids, *admit, *drop, *levels, *shares;
    if (!PyArg_ParseTuple(args, "O!O!OOO!O!", &PyTuple_Type, &jobs, &PyTuple_Type, &ids, &admit, &drop,
                          &PyDict_Type, &levels, &PyDict_Type, &shares))
        return NULL;
    Py_ssize_t n = PyTuple_GET_SIZE(jobs);
    if (PyTuple_GET_SIZE(ids) != n)
        return not_implemented();
    for (Py_ssize_t k = 0; k < n; k++)
        if (!PyTuple_Check(PyTuple_GET_ITEM(jobs, k)) || PyTuple_GET_SIZE(PyTuple_GET_ITEM(jobs, k)) < 10)
            return not_implemented();
    int any_admit = PyObject_IsTrue(admit), any_drop = PyObject_IsTrue(drop);
    if (any_admit < 0 || any_drop < 0)
        return NULL;
    PyObject *out = PyList_New(0), *base = PyDict_New(), *zero = PyLong_FromLong(0), *res = NULL;
    if (!out || !base || !zero)
        goto done;
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *j = PyTuple_GET_ITEM(jobs, k), *id = PyTuple_GET_ITEM(ids, k);
        int ok = PyObject_IsTrue(PyTuple_GET_ITEM(j, 7));
        if (ok == 0 && any_admit)
            ok = PySequence_Contains(admit, id);
        if (ok > 0 && any_drop) {
            int in = PySequence_Contains(drop, id);
            ok = in < 0 ? -1 : !in;
        }
        if (ok < 0)
            goto done;
        if (!ok)
            continue;
        PyObject *jid = PyObject_GetAttr(PyTuple_GET_ITEM(j, 0), str_job_id), *lv, *counts = NULL;
        if (!jid)
            goto done;
        if (!(lv = PyDict_GetItemWithError(levels, jid))) {
            if (!PyErr_Occurred())
                PyErr_SetObject(PyExc_KeyError, jid);
            Py_DECREF(jid);
            goto done;
        }
        Py_ssize_t m = (counts = PyObject_GetAttr(lv, str_count_list)) ? PyObject_Size(counts) : -1;
        Py_XDECREF(counts);
        PyObject *share = m > 1 ? PyDict_GetItemWithError(shares, jid) : NULL;
        int bad = m < 0 || (m > 1 && ((!share && PyErr_Occurred()) || PyList_Append(out, j) < 0 ||
                                      PyDict_SetItem(base, jid, share ? share : zero) < 0));
        Py_DECREF(jid);
        if (bad)
            goto done;
    }
    res = PyTuple_Pack(2, out, base);
done:
    Py_XDECREF(out);
    Py_XDECREF(base);
    Py_XDECREF(zero);
    return res;
}

/* placer_inputs(ids, held, allocation): place_buddy's opening: the GPUs
 * each job of ``ids`` holds (``held``), in ``ids`` order, and the counts
 * wanted: ``allocation`` less its entries that are not > 0 when one of its
 * counts equals 0, else a copy of it. */
static PyObject *
placer_inputs(PyObject *self, PyObject *args)
{
    PyObject *ids, *held, *alloc;
    if (!PyArg_ParseTuple(args, "O!O!O!", &PyTuple_Type, &ids, &PyDict_Type, &held, &PyDict_Type, &alloc))
        return NULL;
    PyObject *current = PyDict_New(), *want = NULL, *zero = PyLong_FromLong(0), *out = NULL, *key, *value;
    if (!current || !zero)
        goto done;
    for (Py_ssize_t k = 0; k < PyTuple_GET_SIZE(ids); k++) {
        PyObject *jid = PyTuple_GET_ITEM(ids, k), *gpus = PyDict_GetItemWithError(held, jid);
        if (!gpus && PyErr_Occurred())
            goto done;
        if (gpus && PyDict_SetItem(current, jid, gpus) < 0)
            goto done;
    }
    int has_zero = 0;
    Py_ssize_t pos = 0;
    while (!has_zero && PyDict_Next(alloc, &pos, &key, &value))  /* 0 in allocation.values() */
        if ((has_zero = PyObject_RichCompareBool(value, zero, Py_EQ)) < 0)
            goto done;
    if (!has_zero) {
        want = PyDict_Copy(alloc);
    } else if ((want = PyDict_New())) {
        pos = 0;
        while (PyDict_Next(alloc, &pos, &key, &value)) {
            int pos_n = PyObject_RichCompareBool(value, zero, Py_GT);
            if (pos_n < 0 || (pos_n && PyDict_SetItem(want, key, value) < 0))
                goto done;
        }
    }
    if (want)
        out = PyTuple_Pack(2, current, want);
done:
    Py_XDECREF(current);
    Py_XDECREF(want);
    Py_XDECREF(zero);
    return out;
}

/* elan_runs(steps, a, b): elan_event's two runs (_follow) from their
 * starts (elan_event.Start tuples) to their sums. ``steps``: the step
 * order's columns (job, GPUs added, the job's GPUs and rate after). The
 * heaps hold (time, job) entries in Python's tuple order; a popped entry
 * counts only while its job is present at that time (stale ones are
 * dropped), as in the Python heaps, so each run pops the same completions
 * and does the same arithmetic in the same order. Returns (acc_a, rest_a,
 * acc_b, rest_b), a run's sum being acc + sum(rest) (rest: the present
 * jobs' completion times, summed by the caller as Python sums; None: no
 * job left), or None where the rule needs capped steps. NotImplemented for
 * other arrays, a time or speed not finite, or an empty heap. */

typedef struct {
    double t;
    Py_ssize_t x;
} HeapEntry;

typedef struct {
    HeapEntry *e;
    Py_ssize_t n, cap;
} Heap;

static inline int
entry_less(const HeapEntry *p, const HeapEntry *q)
{
    return p->t < q->t || (p->t == q->t && p->x < q->x);
}

static int
heap_push(Heap *h, double t, Py_ssize_t x)
{
    if (h->n == h->cap) {
        Py_ssize_t cap = h->cap ? 2 * h->cap : 64;
        HeapEntry *e = PyMem_Realloc(h->e, cap * sizeof(HeapEntry));
        if (!e)
            return -1;
        h->e = e;
        h->cap = cap;
    }
    HeapEntry it = {t, x};
    Py_ssize_t i = h->n++;
    while (i > 0) {
        Py_ssize_t up = (i - 1) / 2;
        if (!entry_less(&it, &h->e[up]))
            break;
        h->e[i] = h->e[up];
        i = up;
    }
    h->e[i] = it;
    return 0;
}

static HeapEntry
heap_pop(Heap *h)
{
    HeapEntry top = h->e[0], last = h->e[--h->n];
    Py_ssize_t i = 0, n = h->n;
    for (;;) {
        Py_ssize_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && entry_less(&h->e[c + 1], &h->e[c]))
            c++;
        if (!entry_less(&h->e[c], &last))
            break;
        h->e[i] = h->e[c];
        i = c;
    }
    if (n)
        h->e[i] = last;
    return top;
}

typedef struct {  /* elan_event._Alloc */
    char *present;
    int64_t *held;
    double *spd;
    Py_ssize_t ptr;
    long long left, live;
} RunAlloc;

enum { RUN_ON, RUN_ACC, RUN_REST };  /* going on; done: acc alone; done: acc + the present jobs' times */

typedef struct {  /* elan_event._Run */
    double *fin, acc;
    Heap heap;
    RunAlloc *al;
    int done;
} EventRun;

typedef struct {
    const int64_t *oj, *on, *oc;
    const double *os;
    Py_ssize_t end, n;
    int64_t *mark, epoch;  /* jobs moved at one completion: mark[y] == epoch */
    Py_ssize_t *moved, *took;  /* those jobs, once each; the steps taken, in order */
    double *news;
} StepCols;

enum { EV_OK = 0, EV_ERROR = -1, EV_CAPPED = -2, EV_BACK = -3 };  /* BACK: hand the case back */

/* The run's next completion: its heap's first entry whose job is present
 * at that time (stale ones dropped). */
static int
pop_live(EventRun *r, HeapEntry *got)
{
    const char *present = r->al->present;
    while (r->heap.n) {
        HeapEntry e = heap_pop(&r->heap);
        if (present[e.x] && r->fin[e.x] == e.t) {
            *got = e;
            return EV_OK;
        }
    }
    return EV_BACK;
}

/* _fit: the rule's steps that fit in the GPUs left, from al->ptr on (al->ptr
 * and al->left move on; each job taken gets its GPUs and, in c->news, its
 * last new speed). The steps taken are listed in c->took, in order (``*k``
 * of them), and their jobs in c->moved, once each (``*nm``). EV_CAPPED
 * where a step needs more GPUs than are left while some are free. */
static int
take_steps(StepCols *c, RunAlloc *al, Py_ssize_t *k, Py_ssize_t *nm)
{
    Py_ssize_t ptr = al->ptr;
    long long left = al->left;
    int64_t ep = ++c->epoch;
    *k = *nm = 0;
    while (ptr < c->end) {
        Py_ssize_t y = c->oj[ptr];
        if (al->present[y]) {
            long long need = c->on[ptr];
            if (need > left) {
                if (left)
                    return EV_CAPPED;
                break;
            }
            al->held[y] = c->oc[ptr];
            c->news[y] = c->os[ptr];
            left -= need;
            c->took[(*k)++] = ptr;
            if (c->mark[y] != ep) {
                c->mark[y] = ep;
                c->moved[(*nm)++] = y;
            }
        }
        ptr++;
    }
    al->ptr = ptr;
    al->left = left;
    return EV_OK;
}

/* Job x of run r's allocation ends: its GPUs are free again. */
static void
release_job(RunAlloc *al, Py_ssize_t x)
{
    al->present[x] = 0;
    al->live--;
    al->left += al->held[x];
    al->held[x] = 0;
}

/* _alone: one completion of run r by itself (_event): each job moved gets
 * its new speed once, its completion time moved by the ratio of the old
 * speed to the new. */
static int
run_alone(StepCols *c, EventRun *r)
{
    RunAlloc *al = r->al;
    if (al->ptr >= c->end) {
        r->done = RUN_REST;
        return EV_OK;
    }
    HeapEntry e;
    if (pop_live(r, &e) < 0)
        return EV_BACK;
    double t = e.t;
    r->acc += t;
    release_job(al, e.x);
    Py_ssize_t k, nm;
    int st = take_steps(c, al, &k, &nm);
    for (Py_ssize_t i = 0; i < nm && st == EV_OK; i++) {
        Py_ssize_t y = c->moved[i];
        double s = c->news[y], f = t + (r->fin[y] - t) * (al->spd[y] / s);
        if (!isfinite(f))
            return EV_BACK;
        r->fin[y] = f;
        al->spd[y] = s;
        if (heap_push(&r->heap, f, y) < 0)
            return EV_ERROR;
    }
    if (st == EV_OK && !al->live)
        r->done = RUN_ACC;
    return st;
}

/* _together: completions of both runs (sharing a's allocation) while they
 * end the same job next; a new speed moves both runs' completion times,
 * step by step. */
static int
run_together(StepCols *c, EventRun *a, EventRun *b)
{
    RunAlloc *al = a->al;
    double *sp = al->spd, *fa = a->fin, *fb = b->fin;
    while (al->ptr < c->end) {
        HeapEntry ea, eb;
        if (pop_live(a, &ea) < 0 || pop_live(b, &eb) < 0)
            return EV_BACK;
        double ta = ea.t, tb = eb.t;
        if (ea.x != eb.x) {
            if (heap_push(&a->heap, ta, ea.x) < 0 || heap_push(&b->heap, tb, eb.x) < 0)
                return EV_ERROR;
            return EV_OK;
        }
        a->acc += ta;
        b->acc += tb;
        if (al->live == 1) {
            al->present[ea.x] = 0;
            al->live = 0;
            a->done = b->done = RUN_ACC;
            return EV_OK;
        }
        release_job(al, ea.x);
        Py_ssize_t k, nm;
        int st = take_steps(c, al, &k, &nm);
        if (st != EV_OK)
            return st;
        for (Py_ssize_t i = 0; i < k; i++) {
            Py_ssize_t p = c->took[i], y = c->oj[p];
            double s = c->os[p], q = sp[y] / s;
            sp[y] = s;
            fa[y] = ta + (fa[y] - ta) * q;
            fb[y] = tb + (fb[y] - tb) * q;
            if (!isfinite(fa[y]) || !isfinite(fb[y]))
                return EV_BACK;
        }
        for (Py_ssize_t i = 0; i < nm; i++) {
            Py_ssize_t y = c->moved[i];
            if (heap_push(&a->heap, fa[y], y) < 0 || heap_push(&b->heap, fb[y], y) < 0)
                return EV_ERROR;
        }
    }
    a->done = b->done = RUN_REST;
    return EV_OK;
}

static int
allocs_same(const RunAlloc *p, const RunAlloc *q, Py_ssize_t n)
{
    return p->live == q->live && p->left == q->left && !memcmp(p->held, q->held, n * sizeof(int64_t))
           && !memcmp(p->present, q->present, n);
}

/* _follow's loop on two started runs. */
static int
follow_runs(StepCols *c, EventRun *a, EventRun *b, RunAlloc *spare)
{
    Py_ssize_t n = c->n;
    int st = run_alone(c, a);
    while (st == EV_OK && (!a->done || !b->done)) {
        if (!a->done && !b->done && allocs_same(a->al, b->al, n)) {
            if (b->al->ptr > a->al->ptr)
                a->al->ptr = b->al->ptr;
            b->al = a->al;
            if ((st = run_together(c, a, b)) != EV_OK)
                break;
            if (!a->done) {  /* b goes on with its own copy */
                const RunAlloc *src = a->al;
                memcpy(spare->present, src->present, n);
                memcpy(spare->held, src->held, n * sizeof(int64_t));
                memcpy(spare->spd, src->spd, n * sizeof(double));
                spare->ptr = src->ptr;
                spare->left = src->left;
                spare->live = src->live;
                b->al = spare;
            }
        }
        if (!a->done && (st = run_alone(c, a)) != EV_OK)
            break;
        if (!b->done && (st = run_alone(c, b)) != EV_OK)
            break;
    }
    return st;
}

/* A Start tuple's arrays copied into a run's own storage (0), or EV_BACK. */
static int
run_from(PyObject *start, Py_ssize_t n, EventRun *r, RunAlloc *al)
{
    PyObject *fin_o, *pres_o, *held_o, *spd_o;
    Py_ssize_t ptr;
    long long left, live;
    double acc;
    if (!PyTuple_Check(start) || PyTuple_GET_SIZE(start) != 8
        || !PyArg_ParseTuple(start, "OOOOnLLd", &fin_o, &pres_o, &held_o, &spd_o, &ptr, &left, &live, &acc)) {
        PyErr_Clear();
        return EV_BACK;
    }
    Py_buffer fv, pv, hv, sv;
    int got = 0, st = EV_BACK;
    if (get_f64(fin_o, &fv, 1, 0, 0) < 0)
        return EV_BACK;
    got++;
    if (get_bool(pres_o, &pv, 0) < 0)
        goto done;
    got++;
    if (get_i64(held_o, &hv, 0) < 0)
        goto done;
    got++;
    if (get_f64(spd_o, &sv, 1, 0, 0) < 0)
        goto done;
    got++;
    if (fv.shape[0] != n || pv.shape[0] != n || hv.shape[0] != n || sv.shape[0] != n)
        goto done;
    const double *fin = fv.buf, *spd = sv.buf;
    const char *present = pv.buf;
    for (Py_ssize_t x = 0; x < n; x++) {
        if (present[x] && !(isfinite(fin[x]) && isfinite(spd[x]) && spd[x] > 0.0))
            goto done;
    }
    memcpy(r->fin, fin, n * sizeof(double));
    memcpy(al->present, present, n);
    memcpy(al->held, hv.buf, n * sizeof(int64_t));
    memcpy(al->spd, spd, n * sizeof(double));
    al->ptr = ptr;
    al->left = left;
    al->live = live;
    r->acc = acc;
    r->al = al;
    r->done = RUN_ON;
    st = EV_OK;
    for (Py_ssize_t x = 0; x < n && st == EV_OK; x++) {
        if (present[x] && heap_push(&r->heap, fin[x], x) < 0)
            st = EV_ERROR;
    }
done:
    if (got > 3)
        PyBuffer_Release(&sv);
    if (got > 2)
        PyBuffer_Release(&hv);
    if (got > 1)
        PyBuffer_Release(&pv);
    PyBuffer_Release(&fv);
    return st;
}

/* A finished run's (acc, rest) for the caller's sum. */
static int
run_result(PyObject *out, Py_ssize_t at, const EventRun *r, Py_ssize_t n)
{
    PyObject *acc = PyFloat_FromDouble(r->acc), *rest = Py_None;
    if (!acc)
        return -1;
    PyTuple_SET_ITEM(out, at, acc);
    if (r->done == RUN_REST) {
        if (!(rest = PyList_New(0)))
            return -1;
        for (Py_ssize_t x = 0; x < n; x++) {
            if (!r->al->present[x])
                continue;
            PyObject *f = PyFloat_FromDouble(r->fin[x]);
            if (!f || PyList_Append(rest, f) < 0) {
                Py_XDECREF(f);
                Py_DECREF(rest);
                return -1;
            }
            Py_DECREF(f);
        }
    } else {
        Py_INCREF(rest);
    }
    PyTuple_SET_ITEM(out, at + 1, rest);
    return 0;
}

static PyObject *
elan_runs(PyObject *self, PyObject *args)
{
    PyObject *steps, *sa, *sb;
    if (!PyArg_ParseTuple(args, "O!OO", &PyTuple_Type, &steps, &sa, &sb))
        return NULL;
    if (PyTuple_GET_SIZE(steps) != 4)
        return not_implemented();
    Py_buffer jv, nv, cv, ov;
    if (get_i64(PyTuple_GET_ITEM(steps, 0), &jv, 0) < 0)
        return not_implemented();
    if (get_i64(PyTuple_GET_ITEM(steps, 1), &nv, 0) < 0) {
        PyBuffer_Release(&jv);
        return not_implemented();
    }
    if (get_i64(PyTuple_GET_ITEM(steps, 2), &cv, 0) < 0) {
        PyBuffer_Release(&jv);
        PyBuffer_Release(&nv);
        return not_implemented();
    }
    if (get_f64(PyTuple_GET_ITEM(steps, 3), &ov, 1, 0, 0) < 0) {
        PyBuffer_Release(&jv);
        PyBuffer_Release(&nv);
        PyBuffer_Release(&cv);
        return not_implemented();
    }
    PyObject *out = NULL;
    StepCols c = {jv.buf, nv.buf, cv.buf, ov.buf, jv.shape[0], 0, NULL, 0, NULL, NULL, NULL};
    EventRun a = {0}, b = {0};
    RunAlloc s0 = {0}, s1 = {0};
    char *block = NULL;
    Py_ssize_t n = -1;
    PyObject *fin_a = PyTuple_Check(sa) && PyTuple_GET_SIZE(sa) == 8 ? PyTuple_GET_ITEM(sa, 0) : NULL;
    if (fin_a) {
        Py_buffer fv;
        if (get_f64(fin_a, &fv, 1, 0, 0) == 0) {
            n = fv.shape[0];
            PyBuffer_Release(&fv);
        }
    }
    int st = EV_BACK;
    if (n < 0 || nv.shape[0] != c.end || cv.shape[0] != c.end || ov.shape[0] != c.end)
        goto done;
    for (Py_ssize_t k = 0; k < c.end; k++) {
        if (c.oj[k] < 0 || c.oj[k] >= n || c.on[k] < 0 || !(isfinite(c.os[k]) && c.os[k] > 0.0))
            goto done;
    }
    c.n = n;
    /* per job: 5 doubles (two runs' times, the new speeds, two allocations' speeds), 3 int64 (two
     * allocations' GPUs, the marks), one index (moved), 2 flags (two allocations' present); per step:
     * one index (took) */
    size_t per = 5 * sizeof(double) + 3 * sizeof(int64_t) + sizeof(Py_ssize_t) + 2;
    size_t size = (size_t)n * per + (size_t)c.end * sizeof(Py_ssize_t) + 1;
    if (!(block = PyMem_Calloc(1, size))) {
        PyErr_NoMemory();
        goto done;
    }
    double *d = (double *)block;
    a.fin = d;
    b.fin = d + n;
    c.news = d + 2 * n;
    s0.spd = d + 3 * n;
    s1.spd = d + 4 * n;
    int64_t *i = (int64_t *)(d + 5 * n);
    s0.held = i;
    s1.held = i + n;
    c.moved = (Py_ssize_t *)(i + 2 * n);
    c.mark = (int64_t *)(c.moved + n);
    c.took = (Py_ssize_t *)(c.mark + n);
    s0.present = (char *)(c.took + c.end);
    s1.present = s0.present + n;
    if ((st = run_from(sa, n, &a, &s0)) == EV_OK && (st = run_from(sb, n, &b, &s1)) == EV_OK) {
        if ((a.al->ptr < 0 || a.al->ptr > c.end) || (b.al->ptr < 0 || b.al->ptr > c.end))
            st = EV_BACK;
        else
            st = follow_runs(&c, &a, &b, &s1);
    }
    if (st == EV_CAPPED) {
        Py_INCREF(Py_None);
        out = Py_None;
    } else if (st == EV_OK) {
        out = PyTuple_New(4);
        if (out && (run_result(out, 0, &a, n) < 0 || run_result(out, 2, &b, n) < 0))
            Py_CLEAR(out);
    }
done:
    if (st == EV_BACK && !PyErr_Occurred())
        out = not_implemented();
    else if (st == EV_ERROR && !PyErr_Occurred())
        PyErr_NoMemory();
    PyMem_Free(a.heap.e);
    PyMem_Free(b.heap.e);
    PyMem_Free(block);
    PyBuffer_Release(&jv);
    PyBuffer_Release(&nv);
    PyBuffer_Release(&cv);
    PyBuffer_Release(&ov);
    return out;
}

static PyMethodDef methods[] = {
    {"elan_runs", elan_runs, METH_VARARGS,
     "elan_runs(steps, a, b): elan_event's two runs from their starts: (acc_a, rest_a, acc_b, rest_b) or None."},
    {"placer_start", placer_start, METH_VARARGS,
     "placer_start(current, want, mask): (jobs that keep their GPUs, jobs to place); clears the others' GPUs."},
    {"placer_inputs", placer_inputs, METH_VARARGS,
     "placer_inputs(ids, held, allocation): (held GPUs in ids order, wanted counts) of place_buddy."},
    {"runnable", runnable, METH_VARARGS,
     "runnable(jobs, ids, admit, drop, levels, shares): (jobs, base) of _Context.runnable."},
    {"advance_rows", advance_rows, METH_VARARGS,
     "advance_rows(S, M, L, n, now, useful): RunSet.advance's arithmetic (useful + gains, or the gains)."},
    {"changed_jobs", changed_jobs, METH_VARARGS,
     "changed_jobs(alloc, placement, held): jobs not placed on the very GPUs they hold, or on another count."},
    {"gpus_change", gpus_change, METH_VARARGS,
     "gpus_change(gpus, jid, owner, used, node_of, free, node_gpus, by_free): ViewCache's owners and free lists."},
    {"row_views", row_views, METH_VARARGS,
     "row_views(cls, cols, counters): (ids, views) of the running rows with an id (Rows.columns)."},
    {"las_floors", las_floors, METH_VARARGS,
     "las_floors(jobs, base, split, levels, thresholds, queues, free, classes, weights): Tidal._floors' loops."},
    {"levels_of", levels_of, METH_VARARGS,
     "levels_of(jobs, by_job, make): _Memo.levels_of's loop (job id -> levels), keeping by_job."},
    {"greedy_open", greedy_open, METH_VARARGS,
     "greedy_open(entries, free): (binds, jobs with a chain, largest first need, levels) of greedy's opening."},
    {"steps_input", steps_input, METH_VARARGS,
     "steps_input(jobs, levels, base, shares, weights, tables, make, inf): algorithm2_input's loop."},
    {"merge_open", merge_open, METH_VARARGS,
     "merge_open(entries, jobs, cur, free, chain): greedy._merge (GPUs left, queue entries); moves cur on."},
    {"merge_cut", merge_cut, METH_VARARGS,
     "merge_cut(tables, free): the rows greedy's merge takes, per job, the GPUs left and the stopping job."},
    {"first_free", first_free, METH_VARARGS,
     "first_free(used, prefer, s): the first free aligned block of s GPUs around one of prefer, or None."},
    {"counts", counts, METH_VARARGS,
     "counts(used, bytes, free8, swf, nps): NodeBits' arrays of a used mask, written in place."},
    {"best_whole_nodes", best_whole_nodes, METH_VARARGS,
     "best_whole_nodes(free8, swf, s, sw_sz): NodeBits.best_whole_nodes on its arrays."},
    {"set_range", set_range, METH_VARARGS,
     "set_range(bytes, free8, swf, lo, hi, used, nps): NodeBits.set_range on its arrays."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tidal.scheduler._fastbits",
    "Compiled kernels of the scheduling core (see tidal.scheduler.kernels).", -1, methods,
};

PyMODINIT_FUNC
PyInit__fastbits(void)
{
    if (!(str_chains = PyUnicode_InternFromString("chains")) || !(str_ext = PyUnicode_InternFromString("ext"))
        || !(str_gain = PyUnicode_InternFromString("gain")) || !(str_to = PyUnicode_InternFromString("to"))
        || !(str_job_id = PyUnicode_InternFromString("job_id"))
        || !(str_deadline = PyUnicode_InternFromString("deadline"))
        || !(str_count_list = PyUnicode_InternFromString("count_list"))
        || !(str_lead = PyUnicode_InternFromString("lead")) || !(str_end = PyUnicode_InternFromString("end"))
        || !(str_ef_class = PyUnicode_InternFromString("ef_class"))
        || !(str_tiresias_base = PyUnicode_InternFromString("tiresias_base"))
        || !(str_holds_gpus = PyUnicode_InternFromString("holds_gpus"))
        || !(str_submit_time = PyUnicode_InternFromString("submit_time")))
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m && PyModule_AddIntConstant(m, "API", 9) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
