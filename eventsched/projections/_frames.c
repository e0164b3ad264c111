/* Columns straight from the log's frames, for the history fold
 * (eventsched/projections/history_frames.py has the Python side and the
 * reasons).
 *
 * A Sink walks a frame's msgpack payload (an array of events, each a map
 * tagged by "type") and appends the events of the types in its plan to
 * per-field column buffers, without making a Python object per event.
 * The plan (field names, kinds, defaults, integer bounds) comes from
 * Python, read from the msgspec structs themselves.
 *
 * Only what msgspec would decode the same way is taken: exact kinds (a bool
 * is no int; an int is a float as msgspec allows), valid UTF-8, each known
 * field at most once, required fields present. Any other event (another
 * type, an unknown or repeated key, a non-empty nested field, an integer
 * out of the plan's bounds, a command that needs quoting...) is handed to
 * the `odd` callback as a byte range, in order, for msgspec to decode.
 * A frame whose structure is broken, or whose events' seq is not their
 * position, makes feed() undo the frame and return None: the caller decodes
 * it the ordinary way (and so raises the ordinary error).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

enum {
    K_INT = 1, K_FLOAT, K_STR, K_BOOL, K_OPT_INT, K_OPT_FLOAT, K_LIST_INT, K_OPT_LIST_INT,
    K_CMD, K_LITERAL, K_EMPTY_MAP, K_EMPTY_LIST, K_STRUCT,
    /* checked, never stored: a job's environment and limits; a sample's memory
       per job is stored (when the plan says so) as flat key, value items */
    K_MAP_STR_STR, K_MAP_STR_LIST_INT, K_MAP_INT_INT
};

typedef struct { char *p; size_t len, cap; } Buf;

typedef struct {
    Buf data;    /* int64 / double / uint8 values, or string bytes */
    Buf offs;    /* int64 string offsets (starts with 0) */
    Buf valid;   /* one byte per row: 1 = not null (optional kinds) */
    Buf flat;    /* list[int]: the int64 items of every row */
    Buf counts;  /* list[int]: int64 items per row */
} Col;

typedef struct {
    const char *name; Py_ssize_t name_len;
    int kind, parent, required, store;
    int64_t lo, hi;                  /* accepted integers (items too) */
    int def_null; int64_t def_i; double def_f;
    const char *def_s; Py_ssize_t def_n;
    const char **lits; Py_ssize_t *lit_n; int n_lits;
    int *children; int n_children;   /* K_STRUCT: its fields, in order */
} Field;

typedef struct {
    int null; int64_t i; double f;
    const char *s; Py_ssize_t n;     /* strings: into the payload or the plan */
    const unsigned char *lp; uint32_t cnt; /* lists: first item, item count */
} Val;

typedef struct { size_t data, offs, valid, flat, counts; } ColMark;

typedef struct {
    PyObject *cls;
    const char *tag; Py_ssize_t tag_len;
    int nf; Field *f; Val *v; unsigned char *seen; Col *cols;
    int *top; int n_top;             /* top-level fields */
    Py_ssize_t rows;
    int seq_f, ts_f;
    Py_ssize_t mark_rows; ColMark *mark;
} TypeP;

typedef struct {
    PyObject_HEAD
    PyObject *plan;   /* keeps the names, defaults and classes alive */
    PyObject *order;  /* dict: class -> None, in order of first appearance */
    int nt; TypeP *t;
} Sink;

/* --- buffers ------------------------------------------------------------ */

/* Raw allocation: feed() fills buffers without the GIL. -1: out of memory
   (no exception set: the caller sets it once it holds the GIL again). */
static int buf_reserve(Buf *b, size_t more) {
    if (b->len + more <= b->cap) return 0;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + more) cap *= 2;
    char *p = PyMem_RawRealloc(b->p, cap);
    if (p == NULL) return -1;
    b->p = p; b->cap = cap;
    return 0;
}

static inline int buf_put(Buf *b, const void *src, size_t n) {
    if (buf_reserve(b, n) < 0) return -1;
    memcpy(b->p + b->len, src, n);
    b->len += n;
    return 0;
}

static inline int put_i64(Buf *b, int64_t v) { return buf_put(b, &v, 8); }
static inline int put_u8(Buf *b, unsigned char v) { return buf_put(b, &v, 1); }

static int put_decimal(Buf *b, int64_t v) {
    char tmp[24]; int n = 0;
    uint64_t u = v < 0 ? (uint64_t)0 - (uint64_t)v : (uint64_t)v;
    do { tmp[n++] = (char)('0' + u % 10); u /= 10; } while (u);
    if (v < 0) tmp[n++] = '-';
    if (buf_reserve(b, (size_t)n) < 0) return -1;
    while (n) b->p[b->len++] = tmp[--n];
    return 0;
}

/* --- reading msgpack ---------------------------------------------------- */

typedef struct { const unsigned char *p, *end; } Rd;

static inline int need(Rd *r, size_t n) { return (size_t)(r->end - r->p) >= n; }
static inline uint16_t be16(const unsigned char *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t be64(const unsigned char *p) { return ((uint64_t)be32(p) << 32) | be32(p + 4); }

/* an integer that fits int64: 1; anything else (or truncated): 0 */
static int rd_int(Rd *r, int64_t *out) {
    if (!need(r, 1)) return 0;
    unsigned char c = *r->p;
    if (c <= 0x7f) { *out = c; r->p++; return 1; }
    if (c >= 0xe0) { *out = (int8_t)c; r->p++; return 1; }
    size_t n;
    switch (c) {
    case 0xcc: case 0xd0: n = 1; break;
    case 0xcd: case 0xd1: n = 2; break;
    case 0xce: case 0xd2: n = 4; break;
    case 0xcf: case 0xd3: n = 8; break;
    default: return 0;
    }
    if (!need(r, 1 + n)) return 0;
    const unsigned char *p = r->p + 1;
    switch (c) {
    case 0xcc: *out = p[0]; break;
    case 0xcd: *out = be16(p); break;
    case 0xce: *out = be32(p); break;
    case 0xcf: { uint64_t u = be64(p); if (u > (uint64_t)INT64_MAX) return 0; *out = (int64_t)u; break; }
    case 0xd0: *out = (int8_t)p[0]; break;
    case 0xd1: *out = (int16_t)be16(p); break;
    case 0xd2: *out = (int32_t)be32(p); break;
    case 0xd3: *out = (int64_t)be64(p); break;
    }
    r->p += 1 + n;
    return 1;
}

/* a float, or an integer as a float (msgspec accepts both for float fields) */
static int rd_float(Rd *r, double *out) {
    if (!need(r, 1)) return 0;
    unsigned char c = *r->p;
    if (c == 0xcb) {
        if (!need(r, 9)) return 0;
        uint64_t u = be64(r->p + 1); memcpy(out, &u, 8); r->p += 9; return 1;
    }
    if (c == 0xca) {
        if (!need(r, 5)) return 0;
        uint32_t u = be32(r->p + 1); float f; memcpy(&f, &u, 4); *out = f; r->p += 5; return 1;
    }
    int64_t i;
    if (!rd_int(r, &i)) return 0;
    *out = (double)i;
    return 1;
}

/* strict UTF-8, as Python's decoder (no overlongs, surrogates or > U+10FFFF) */
static int utf8_ok(const unsigned char *s, Py_ssize_t n) {
    Py_ssize_t i = 0;
    while (i < n) {
        unsigned char c = s[i];
        if (c < 0x80) { i++; continue; }
        int k; unsigned char lo = 0x80, hi = 0xbf;
        if (c >= 0xc2 && c <= 0xdf) k = 1;
        else if (c == 0xe0) { k = 2; lo = 0xa0; }
        else if (c >= 0xe1 && c <= 0xec) k = 2;
        else if (c == 0xed) { k = 2; hi = 0x9f; }
        else if (c >= 0xee && c <= 0xef) k = 2;
        else if (c == 0xf0) { k = 3; lo = 0x90; }
        else if (c >= 0xf1 && c <= 0xf3) k = 3;
        else if (c == 0xf4) { k = 3; hi = 0x8f; }
        else return 0;
        if (i + k >= n) return 0;  /* truncated sequence */
        if (s[i + 1] < lo || s[i + 1] > hi) return 0;
        for (int j = 2; j <= k; j++)
            if (s[i + j] < 0x80 || s[i + j] > 0xbf) return 0;
        i += k + 1;
    }
    return 1;
}

/* a str's bytes (not checked for UTF-8) */
static int rd_strhead(Rd *r, const char **s, Py_ssize_t *n) {
    if (!need(r, 1)) return 0;
    unsigned char c = *r->p;
    size_t h, len;
    if ((c & 0xe0) == 0xa0) { h = 1; len = c & 0x1f; }
    else if (c == 0xd9) { if (!need(r, 2)) return 0; h = 2; len = r->p[1]; }
    else if (c == 0xda) { if (!need(r, 3)) return 0; h = 3; len = be16(r->p + 1); }
    else if (c == 0xdb) { if (!need(r, 5)) return 0; h = 5; len = be32(r->p + 1); }
    else return 0;
    if (!need(r, h + len)) return 0;
    *s = (const char *)r->p + h; *n = (Py_ssize_t)len;
    r->p += h + len;
    return 1;
}

static int rd_str(Rd *r, const char **s, Py_ssize_t *n) {
    return rd_strhead(r, s, n) && utf8_ok((const unsigned char *)*s, *n);
}

static int rd_arrayhead(Rd *r, uint32_t *n) {
    if (!need(r, 1)) return 0;
    unsigned char c = *r->p;
    if ((c & 0xf0) == 0x90) { *n = c & 0x0f; r->p++; return 1; }
    if (c == 0xdc) { if (!need(r, 3)) return 0; *n = be16(r->p + 1); r->p += 3; return 1; }
    if (c == 0xdd) { if (!need(r, 5)) return 0; *n = be32(r->p + 1); r->p += 5; return 1; }
    return 0;
}

static int rd_maphead(Rd *r, uint32_t *n) {
    if (!need(r, 1)) return 0;
    unsigned char c = *r->p;
    if ((c & 0xf0) == 0x80) { *n = c & 0x0f; r->p++; return 1; }
    if (c == 0xde) { if (!need(r, 3)) return 0; *n = be16(r->p + 1); r->p += 3; return 1; }
    if (c == 0xdf) { if (!need(r, 5)) return 0; *n = be32(r->p + 1); r->p += 5; return 1; }
    return 0;
}

/* step over one object of any kind: only its structure is checked */
static int skip_obj(Rd *r, int depth) {
    if (depth > 64 || !need(r, 1)) return 0;
    unsigned char c = *r->p;
    size_t n = 0;
    uint64_t items = 0;
    if (c <= 0x7f || c >= 0xe0 || c == 0xc0 || c == 0xc2 || c == 0xc3) { r->p++; return 1; }
    if ((c & 0xe0) == 0xa0) n = 1 + (c & 0x1f);
    else if ((c & 0xf0) == 0x90) { r->p++; items = c & 0x0f; goto seq; }
    else if ((c & 0xf0) == 0x80) { r->p++; items = 2u * (c & 0x0f); goto seq; }
    else switch (c) {
    case 0xcc: case 0xd0: n = 2; break;
    case 0xcd: case 0xd1: n = 3; break;
    case 0xce: case 0xd2: case 0xca: n = 5; break;
    case 0xcf: case 0xd3: case 0xcb: n = 9; break;
    case 0xd4: n = 3; break;
    case 0xd5: n = 4; break;
    case 0xd6: n = 6; break;
    case 0xd7: n = 10; break;
    case 0xd8: n = 18; break;
    case 0xd9: case 0xc4: if (!need(r, 2)) return 0; n = 2 + (size_t)r->p[1]; break;
    case 0xda: case 0xc5: if (!need(r, 3)) return 0; n = 3 + (size_t)be16(r->p + 1); break;
    case 0xdb: case 0xc6: if (!need(r, 5)) return 0; n = 5 + (size_t)be32(r->p + 1); break;
    case 0xc7: if (!need(r, 2)) return 0; n = 3 + (size_t)r->p[1]; break;
    case 0xc8: if (!need(r, 3)) return 0; n = 4 + (size_t)be16(r->p + 1); break;
    case 0xc9: if (!need(r, 5)) return 0; n = 6 + (size_t)be32(r->p + 1); break;
    case 0xdc: if (!need(r, 3)) return 0; items = be16(r->p + 1); r->p += 3; goto seq;
    case 0xdd: if (!need(r, 5)) return 0; items = be32(r->p + 1); r->p += 5; goto seq;
    case 0xde: if (!need(r, 3)) return 0; items = 2u * be16(r->p + 1); r->p += 3; goto seq;
    case 0xdf: if (!need(r, 5)) return 0; items = 2u * (uint64_t)be32(r->p + 1); r->p += 5; goto seq;
    default: return 0;  /* 0xc1: never used */
    }
    if (!need(r, n)) return 0;
    r->p += n;
    return 1;
seq:
    while (items--)
        if (!skip_obj(r, depth + 1)) return 0;
    return 1;
}

/* --- one event ---------------------------------------------------------- */

/* a map of one of the checked-only kinds, as msgspec would accept it (a
   repeated key is no error there: the last one wins) */
static int check_map(Rd *r, int kind) {
    uint32_t n;
    if (!rd_maphead(r, &n)) return 0;
    for (uint32_t p = 0; p < n; p++) {
        const char *s; Py_ssize_t len; int64_t x; uint32_t items;
        if (kind == K_MAP_INT_INT) {
            if (!rd_int(r, &x) || !rd_int(r, &x)) return 0;
            continue;
        }
        if (!rd_str(r, &s, &len)) return 0;
        if (kind == K_MAP_STR_STR) {
            if (!rd_str(r, &s, &len)) return 0;
            continue;
        }
        if (!rd_arrayhead(r, &items)) return 0;
        for (uint32_t k = 0; k < items; k++)
            if (!rd_int(r, &x)) return 0;
    }
    return 1;
}

static int parse_fields(Rd *r, TypeP *t, const int *kids, int n_kids, uint32_t pairs);

/* a stored int -> int map: its items kept as a list's (2 per pair); a
   repeated key (msgspec keeps the last) is left to msgspec */
static int int_map(Rd *r, const Field *f, Val *v) {
    if (!rd_maphead(r, &v->cnt) || v->cnt > UINT32_MAX / 2) return 0;
    v->lp = r->p;
    v->cnt *= 2;
    for (uint32_t k = 0; k < v->cnt; k++) {
        int64_t x;
        if (!rd_int(r, &x) || x < f->lo || x > f->hi) return 0;
        if (k % 2 == 0) {  /* a key: not one seen before */
            Rd seen = {v->lp, r->p};
            for (uint32_t j = 0; j < k; j += 2) {
                int64_t key, val;
                rd_int(&seen, &key); rd_int(&seen, &val);
                if (key == x) return 0;
            }
        }
    }
    return 1;
}

static int plain_word(const char *s, Py_ssize_t n) {
    /* history_fold._command joins without quoting when every word is
       non-empty and made of [\w@%+=:,./-] (ASCII) */
    if (n == 0) return 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (!((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '_' ||
              c == '@' || c == '%' || c == '+' || c == '=' || c == ':' || c == ',' || c == '.' ||
              c == '/' || c == '-'))
            return 0;
    }
    return 1;
}

static int parse_value(Rd *r, TypeP *t, int fi) {
    Field *f = &t->f[fi];
    Val *v = &t->v[fi];
    v->null = 0;
    switch (f->kind) {
    case K_OPT_INT:
        if (need(r, 1) && *r->p == 0xc0) { r->p++; v->null = 1; return 1; }
        /* fall through */
    case K_INT:
        return rd_int(r, &v->i) && v->i >= f->lo && v->i <= f->hi;
    case K_OPT_FLOAT:
        if (need(r, 1) && *r->p == 0xc0) { r->p++; v->null = 1; return 1; }
        /* fall through */
    case K_FLOAT:
        return rd_float(r, &v->f);
    case K_STR:
        return rd_str(r, &v->s, &v->n);
    case K_BOOL:
        if (!need(r, 1) || (*r->p != 0xc2 && *r->p != 0xc3)) return 0;
        v->i = *r->p == 0xc3; r->p++;
        return 1;
    case K_OPT_LIST_INT:
        if (need(r, 1) && *r->p == 0xc0) { r->p++; v->null = 1; v->cnt = 0; return 1; }
        /* fall through */
    case K_LIST_INT: {
        if (!rd_arrayhead(r, &v->cnt)) return 0;
        v->lp = r->p;
        for (uint32_t k = 0; k < v->cnt; k++) {
            int64_t x;
            if (!rd_int(r, &x) || x < f->lo || x > f->hi) return 0;
        }
        return 1;
    }
    case K_CMD: {
        if (!rd_arrayhead(r, &v->cnt)) return 0;
        if (v->cnt == 0) return 0;  /* shlex.join([]) is "", but let Python say so */
        v->lp = r->p;
        for (uint32_t k = 0; k < v->cnt; k++) {
            const char *s; Py_ssize_t n;
            if (!rd_strhead(r, &s, &n) || !plain_word(s, n)) return 0;
        }
        return 1;
    }
    case K_LITERAL:
        if (!rd_str(r, &v->s, &v->n)) return 0;
        for (int k = 0; k < f->n_lits; k++)
            if (f->lit_n[k] == v->n && memcmp(f->lits[k], v->s, (size_t)v->n) == 0) return 1;
        return 0;
    case K_EMPTY_MAP: {
        uint32_t n;
        return rd_maphead(r, &n) && n == 0;
    }
    case K_EMPTY_LIST: {
        uint32_t n;
        return rd_arrayhead(r, &n) && n == 0;
    }
    case K_STRUCT: {
        uint32_t n;
        if (!rd_maphead(r, &n)) return 0;
        return parse_fields(r, t, f->children, f->n_children, n);
    }
    case K_MAP_INT_INT:
        if (f->store) return int_map(r, f, v);
        /* fall through */
    case K_MAP_STR_STR: case K_MAP_STR_LIST_INT:
        return check_map(r, f->kind);
    }
    return 0;
}

static void set_default(TypeP *t, int fi) {
    Field *f = &t->f[fi];
    Val *v = &t->v[fi];
    v->null = f->def_null; v->i = f->def_i; v->f = f->def_f;
    v->s = f->def_s; v->n = f->def_n; v->cnt = 0; v->lp = NULL;
}

/* `pairs` key/value pairs of one map, for the fields `kids` */
static int parse_fields(Rd *r, TypeP *t, const int *kids, int n_kids, uint32_t pairs) {
    int cursor = 0;
    for (int k = 0; k < n_kids; k++) t->seen[kids[k]] = 0;
    for (uint32_t p = 0; p < pairs; p++) {
        const char *key; Py_ssize_t kn;
        if (!rd_strhead(r, &key, &kn)) return 0;
        int found = -1;
        /* msgspec writes fields in order: try the one after the last first */
        for (int k = 0; k < n_kids; k++) {
            int fi = kids[(cursor + k) % n_kids];
            if (t->f[fi].name_len == kn && memcmp(t->f[fi].name, key, (size_t)kn) == 0) {
                found = fi; cursor = (cursor + k + 1) % n_kids;
                break;
            }
        }
        if (found < 0 || t->seen[found]) return 0;  /* unknown or repeated: msgspec decides */
        t->seen[found] = 1;
        if (!parse_value(r, t, found)) return 0;
    }
    for (int k = 0; k < n_kids; k++) {
        int fi = kids[k];
        if (t->seen[fi]) continue;
        if (t->f[fi].required) return 0;
        set_default(t, fi);
    }
    return 1;
}

static int put_ids(Col *c, const Val *v, int with_flat) {
    Rd r = {v->lp, (const unsigned char *)-1};
    r.end = v->lp + 10u * v->cnt;  /* the items were read once already */
    for (uint32_t k = 0; k < v->cnt; k++) {
        int64_t x;
        rd_int(&r, &x);
        if (k && put_u8(&c->data, ',') < 0) return -1;
        if (put_decimal(&c->data, x) < 0) return -1;
        if (with_flat && put_i64(&c->flat, x) < 0) return -1;
    }
    return 0;
}

/* append the parsed event's stored fields to the columns */
static int commit(TypeP *t) {
    for (int fi = 0; fi < t->nf; fi++) {
        Field *f = &t->f[fi];
        if (!f->store) continue;
        Val *v = &t->v[fi];
        Col *c = &t->cols[fi];
        switch (f->kind) {
        case K_INT: case K_OPT_INT:
            if (put_i64(&c->data, v->null ? 0 : v->i) < 0) return -1;
            if (f->kind == K_OPT_INT && put_u8(&c->valid, !v->null) < 0) return -1;
            break;
        case K_FLOAT: case K_OPT_FLOAT: {
            double d = v->null ? 0.0 : v->f;
            if (buf_put(&c->data, &d, 8) < 0) return -1;
            if (f->kind == K_OPT_FLOAT && put_u8(&c->valid, !v->null) < 0) return -1;
            break;
        }
        case K_BOOL:
            if (put_u8(&c->data, (unsigned char)v->i) < 0) return -1;
            break;
        case K_STR: case K_LITERAL:
            if (buf_put(&c->data, v->s, (size_t)v->n) < 0) return -1;
            if (put_i64(&c->offs, (int64_t)c->data.len) < 0) return -1;
            break;
        case K_MAP_INT_INT: {
            Rd r = {v->lp, v->lp + 10u * v->cnt};  /* the items were read once already */
            for (uint32_t k = 0; k < v->cnt; k++) {
                int64_t x;
                rd_int(&r, &x);
                if (put_i64(&c->flat, x) < 0) return -1;
            }
            if (put_i64(&c->counts, (int64_t)v->cnt) < 0) return -1;
            break;
        }
        case K_LIST_INT: case K_OPT_LIST_INT:
            if (put_ids(c, v, 1) < 0) return -1;
            if (put_i64(&c->offs, (int64_t)c->data.len) < 0) return -1;
            if (put_u8(&c->valid, !v->null) < 0) return -1;
            if (put_i64(&c->counts, (int64_t)v->cnt) < 0) return -1;
            break;
        case K_CMD: {
            Rd r = {v->lp, (const unsigned char *)-1};
            r.end = (const unsigned char *)UINTPTR_MAX;
            for (uint32_t k = 0; k < v->cnt; k++) {
                const char *s; Py_ssize_t n;
                rd_strhead(&r, &s, &n);
                if (k && put_u8(&c->data, ' ') < 0) return -1;
                if (buf_put(&c->data, s, (size_t)n) < 0) return -1;
            }
            if (put_i64(&c->offs, (int64_t)c->data.len) < 0) return -1;
            break;
        }
        }
    }
    t->rows++;
    return 0;
}

/* --- the Sink ----------------------------------------------------------- */

static void free_types(Sink *s) {
    if (s->t == NULL) return;
    for (int i = 0; i < s->nt; i++) {
        TypeP *t = &s->t[i];
        if (t->cols)
            for (int fi = 0; fi < t->nf; fi++) {
                Col *c = &t->cols[fi];
                PyMem_RawFree(c->data.p); PyMem_RawFree(c->offs.p); PyMem_RawFree(c->valid.p);
                PyMem_RawFree(c->flat.p); PyMem_RawFree(c->counts.p);
            }
        if (t->f)
            for (int fi = 0; fi < t->nf; fi++) {
                PyMem_Free(t->f[fi].children); PyMem_Free(t->f[fi].lits); PyMem_Free(t->f[fi].lit_n);
            }
        PyMem_Free(t->f); PyMem_Free(t->v); PyMem_Free(t->seen); PyMem_Free(t->cols);
        PyMem_Free(t->top); PyMem_Free(t->mark);
    }
    PyMem_Free(s->t);
    s->t = NULL;
}

static void Sink_dealloc(Sink *s) {
    free_types(s);
    Py_XDECREF(s->plan);
    Py_XDECREF(s->order);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static int bytes_of(PyObject *o, const char **s, Py_ssize_t *n) {
    char *p;
    if (!PyBytes_Check(o)) { PyErr_SetString(PyExc_TypeError, "plan: bytes expected"); return -1; }
    if (PyBytes_AsStringAndSize(o, &p, n) < 0) return -1;
    *s = p;
    return 0;
}

/* field: (name: bytes, kind, parent, required, store, lo, hi, default, literals: tuple[bytes]) */
static int load_field(Field *f, PyObject *tup) {
    PyObject *name, *def, *lits;
    long long lo, hi;
    if (!PyArg_ParseTuple(tup, "OiiiiLLOO", &name, &f->kind, &f->parent, &f->required, &f->store, &lo, &hi,
                          &def, &lits))
        return -1;
    f->lo = lo; f->hi = hi;
    if (bytes_of(name, &f->name, &f->name_len) < 0) return -1;
    f->def_null = def == Py_None;
    if (!f->required && def != Py_None) {
        if (PyBytes_Check(def)) {
            if (bytes_of(def, &f->def_s, &f->def_n) < 0) return -1;
        } else if (PyFloat_Check(def)) {
            f->def_f = PyFloat_AsDouble(def);
        } else if (PyLong_Check(def)) {
            f->def_i = PyLong_AsLongLong(def);
            f->def_f = (double)f->def_i;
            if (PyErr_Occurred()) return -1;
        } else {
            PyErr_SetString(PyExc_TypeError, "plan: unsupported default");
            return -1;
        }
    }
    if (lits != Py_None) {
        if (!PyTuple_Check(lits)) { PyErr_SetString(PyExc_TypeError, "plan: literals"); return -1; }
        f->n_lits = (int)PyTuple_GET_SIZE(lits);
        f->lits = PyMem_Calloc((size_t)f->n_lits + 1, sizeof(char *));
        f->lit_n = PyMem_Calloc((size_t)f->n_lits + 1, sizeof(Py_ssize_t));
        if (!f->lits || !f->lit_n) { PyErr_NoMemory(); return -1; }
        for (int k = 0; k < f->n_lits; k++)
            if (bytes_of(PyTuple_GET_ITEM(lits, k), &f->lits[k], &f->lit_n[k]) < 0) return -1;
    }
    return 0;
}

static int add_child(int **arr, int *n, int fi) {
    int *p = PyMem_Realloc(*arr, sizeof(int) * (size_t)(*n + 1));
    if (p == NULL) { PyErr_NoMemory(); return -1; }
    p[(*n)++] = fi; *arr = p;
    return 0;
}

/* type: (cls, tag: bytes, fields: list of field tuples) */
static int load_type(TypeP *t, PyObject *tup) {
    PyObject *cls, *tag, *fields;
    if (!PyArg_ParseTuple(tup, "OOO!", &cls, &tag, &PyList_Type, &fields)) return -1;
    t->cls = cls;
    if (bytes_of(tag, &t->tag, &t->tag_len) < 0) return -1;
    t->nf = (int)PyList_GET_SIZE(fields);
    t->f = PyMem_Calloc((size_t)t->nf + 1, sizeof(Field));
    t->v = PyMem_Calloc((size_t)t->nf + 1, sizeof(Val));
    t->seen = PyMem_Calloc((size_t)t->nf + 1, 1);
    t->cols = PyMem_Calloc((size_t)t->nf + 1, sizeof(Col));
    t->mark = PyMem_Calloc((size_t)t->nf + 1, sizeof(ColMark));
    if (!t->f || !t->v || !t->seen || !t->cols || !t->mark) { PyErr_NoMemory(); return -1; }
    t->seq_f = t->ts_f = -1;
    for (int fi = 0; fi < t->nf; fi++) {
        Field *f = &t->f[fi];
        if (load_field(f, PyList_GET_ITEM(fields, fi)) < 0) return -1;
        if (f->parent < -1 || f->parent >= fi || (f->parent >= 0 && t->f[f->parent].kind != K_STRUCT)) {
            PyErr_SetString(PyExc_ValueError, "plan: bad parent");
            return -1;
        }
        if (f->parent < 0) {
            if (add_child(&t->top, &t->n_top, fi) < 0) return -1;
            if (f->name_len == 3 && memcmp(f->name, "seq", 3) == 0 && f->kind == K_INT && f->store) t->seq_f = fi;
            if (f->name_len == 2 && memcmp(f->name, "ts", 2) == 0 && f->kind == K_FLOAT && f->store) t->ts_f = fi;
        } else if (add_child(&t->f[f->parent].children, &t->f[f->parent].n_children, fi) < 0) {
            return -1;
        }
        if (f->kind == K_STR || f->kind == K_LITERAL || f->kind == K_LIST_INT || f->kind == K_OPT_LIST_INT ||
            f->kind == K_CMD)
            if (put_i64(&t->cols[fi].offs, 0) < 0) { PyErr_NoMemory(); return -1; }
    }
    if (t->seq_f < 0 || t->ts_f < 0) {
        PyErr_SetString(PyExc_ValueError, "plan: a type needs stored seq and ts fields");
        return -1;
    }
    return 0;
}

static PyObject *Sink_new(PyTypeObject *type, PyObject *args, PyObject *kw) {
    PyObject *plan, *order;
    if (!PyArg_ParseTuple(args, "O!O!", &PyList_Type, &plan, &PyDict_Type, &order)) return NULL;
    Sink *s = (Sink *)type->tp_alloc(type, 0);
    if (s == NULL) return NULL;
    Py_INCREF(plan); s->plan = plan;
    Py_INCREF(order); s->order = order;
    s->nt = (int)PyList_GET_SIZE(plan);
    s->t = PyMem_Calloc((size_t)s->nt + 1, sizeof(TypeP));
    if (s->t == NULL) { Py_DECREF(s); return PyErr_NoMemory(); }
    for (int i = 0; i < s->nt; i++)
        if (load_type(&s->t[i], PyList_GET_ITEM(plan, i)) < 0) { Py_DECREF(s); return NULL; }
    return (PyObject *)s;
}

static void save_marks(Sink *s) {
    for (int i = 0; i < s->nt; i++) {
        TypeP *t = &s->t[i];
        t->mark_rows = t->rows;
        for (int fi = 0; fi < t->nf; fi++) {
            Col *c = &t->cols[fi];
            ColMark *m = &t->mark[fi];
            m->data = c->data.len; m->offs = c->offs.len; m->valid = c->valid.len;
            m->flat = c->flat.len; m->counts = c->counts.len;
        }
    }
}

static void restore_marks(Sink *s) {
    for (int i = 0; i < s->nt; i++) {
        TypeP *t = &s->t[i];
        t->rows = t->mark_rows;
        for (int fi = 0; fi < t->nf; fi++) {
            Col *c = &t->cols[fi];
            ColMark *m = &t->mark[fi];
            c->data.len = m->data; c->offs.len = m->offs; c->valid.len = m->valid;
            c->flat.len = m->flat; c->counts.len = m->counts;
        }
    }
}

/* the plan's type of an event map at r (whose "type" key comes first), or -1 */
static int event_type(Sink *s, Rd *r, uint32_t *pairs) {
    const char *key, *tag; Py_ssize_t kn, tn;
    if (!rd_maphead(r, pairs) || *pairs == 0) return -1;
    if (!rd_strhead(r, &key, &kn) || kn != 4 || memcmp(key, "type", 4) != 0) return -1;
    if (!rd_strhead(r, &tag, &tn)) return -1;
    for (int i = 0; i < s->nt; i++)
        if (s->t[i].tag_len == tn && memcmp(s->t[i].tag, tag, (size_t)tn) == 0) return i;
    return -1;
}

/* feed(payload, first_seq, skip, odd) -> (kept, last_index, last_seq, last_ts) | None
 *
 * Events before index `skip` are checked but not kept. odd(index, start, end)
 * is called for each event the plan does not take. None: the frame was
 * undone (see the top of the file). The walk runs without the GIL, so that
 * the fold's writer thread (DuckDB scanning Arrow) is not kept waiting for it. */
static PyObject *Sink_feed(Sink *s, PyObject *args) {
    Py_buffer buf;
    long long first_seq;
    Py_ssize_t skip;
    PyObject *odd;
    if (!PyArg_ParseTuple(args, "y*LnO", &buf, &first_seq, &skip, &odd)) return NULL;
    const unsigned char *base = buf.buf;
    Rd r = {base, base + buf.len};
    Py_ssize_t kept = 0, last_index = -1;
    long long last_seq = 0;
    double last_ts = 0.0;
    uint32_t n;
    int failed = 0;  /* 1: an exception is set; 2: out of memory */
    save_marks(s);
    PyThreadState *ts = PyEval_SaveThread();
#define WITH_GIL(stmt) do { PyEval_RestoreThread(ts); stmt; ts = PyEval_SaveThread(); } while (0)
    if (!rd_arrayhead(&r, &n)) goto undo;
    for (uint32_t i = 0; i < n; i++) {
        const unsigned char *start = r.p;
        uint32_t pairs;
        int ti = event_type(s, &r, &pairs);
        if (ti >= 0) {
            TypeP *t = &s->t[ti];
            if (parse_fields(&r, t, t->top, t->n_top, pairs - 1)) {
                if (t->v[t->seq_f].i != first_seq + (long long)i) goto undo;
                if ((Py_ssize_t)i < skip) continue;
                if (t->rows == 0) {
                    WITH_GIL(failed = PyDict_SetDefault(s->order, t->cls, Py_None) == NULL);
                    if (failed) goto error;
                }
                if (commit(t) < 0) { failed = 2; goto error; }
                kept++; last_index = i;
                last_seq = t->v[t->seq_f].i; last_ts = t->v[t->ts_f].f;
                continue;
            }
        }
        r.p = start;
        if (!skip_obj(&r, 0)) goto undo;
        WITH_GIL({
            PyObject *res = PyObject_CallFunction(odd, "Inn", i, (Py_ssize_t)(start - base),
                                                  (Py_ssize_t)(r.p - base));
            failed = res == NULL;
            Py_XDECREF(res);
        });
        if (failed) goto error;
    }
#undef WITH_GIL
    if (r.p != r.end) goto undo;
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&buf);
    return Py_BuildValue("nnLd", kept, last_index, last_seq, last_ts);
undo:
    restore_marks(s);
    PyEval_RestoreThread(ts);
    PyBuffer_Release(&buf);
    Py_RETURN_NONE;
error:
    PyEval_RestoreThread(ts);
    if (failed == 2) PyErr_NoMemory();
    PyBuffer_Release(&buf);
    return NULL;
}

static PyObject *Sink_rollback(Sink *s, PyObject *unused) {
    restore_marks(s);
    Py_RETURN_NONE;
}

static PyObject *Sink_rows(Sink *s, PyObject *arg) {
    Py_ssize_t i = PyLong_AsSsize_t(arg);
    if (i == -1 && PyErr_Occurred()) return NULL;
    if (i < 0 || i >= s->nt) { PyErr_SetString(PyExc_IndexError, "type"); return NULL; }
    return PyLong_FromSsize_t(s->t[i].rows);
}

static PyObject *bytes_or_none(const Buf *b, int present) {
    if (!present) Py_RETURN_NONE;
    return PyBytes_FromStringAndSize(b->p ? b->p : "", (Py_ssize_t)b->len);
}

/* column(type, field) -> (data, offsets, valid, flat, counts), absent parts None */
static PyObject *Sink_column(Sink *s, PyObject *args) {
    int ti, fi;
    if (!PyArg_ParseTuple(args, "ii", &ti, &fi)) return NULL;
    if (ti < 0 || ti >= s->nt || fi < 0 || fi >= s->t[ti].nf) {
        PyErr_SetString(PyExc_IndexError, "column");
        return NULL;
    }
    int kind = s->t[ti].f[fi].kind;
    Col *c = &s->t[ti].cols[fi];
    int str = kind == K_STR || kind == K_LITERAL || kind == K_CMD || kind == K_LIST_INT || kind == K_OPT_LIST_INT;
    int list = kind == K_LIST_INT || kind == K_OPT_LIST_INT;
    int opt = kind == K_OPT_INT || kind == K_OPT_FLOAT || list;
    int items = list || kind == K_MAP_INT_INT;
    PyObject *parts[5] = {
        bytes_or_none(&c->data, 1), bytes_or_none(&c->offs, str), bytes_or_none(&c->valid, opt),
        bytes_or_none(&c->flat, items), bytes_or_none(&c->counts, items),
    };
    PyObject *out = NULL;
    if (parts[0] && parts[1] && parts[2] && parts[3] && parts[4])
        out = PyTuple_Pack(5, parts[0], parts[1], parts[2], parts[3], parts[4]);
    for (int k = 0; k < 5; k++) Py_XDECREF(parts[k]);
    return out;
}

static PyMethodDef Sink_methods[] = {
    {"feed", (PyCFunction)Sink_feed, METH_VARARGS, "Append one frame's events; None: decode it the ordinary way."},
    {"rollback", (PyCFunction)Sink_rollback, METH_NOARGS, "Undo the last feed."},
    {"rows", (PyCFunction)Sink_rows, METH_O, "Rows of a plan type so far."},
    {"column", (PyCFunction)Sink_column, METH_VARARGS, "A field's buffers."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject SinkType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "eventsched.projections._frames.Sink",
    .tp_basicsize = sizeof(Sink),
    .tp_dealloc = (destructor)Sink_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Column buffers filled from log frames.",
    .tp_methods = Sink_methods,
    .tp_new = Sink_new,
};

/* texts(list[str]) -> (offsets, data): an Arrow large_string column's
   buffers (pyarrow.array would import pandas on its first call) */
static PyObject *texts(PyObject *mod, PyObject *list) {
    if (!PyList_Check(list)) { PyErr_SetString(PyExc_TypeError, "texts: a list of str"); return NULL; }
    Buf offs = {0}, data = {0};
    PyObject *out = NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (buf_reserve(&offs, 8 * (size_t)(n + 1)) < 0 || put_i64(&offs, 0) < 0) { PyErr_NoMemory(); goto done; }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *o = PyList_GET_ITEM(list, i);
        Py_ssize_t len;
        if (!PyUnicode_Check(o)) { PyErr_SetString(PyExc_TypeError, "texts: a list of str"); goto done; }
        const char *u = PyUnicode_AsUTF8AndSize(o, &len);
        if (u == NULL) goto done;
        if (buf_put(&data, u, (size_t)len) < 0 || put_i64(&offs, (int64_t)data.len) < 0) {
            PyErr_NoMemory();
            goto done;
        }
    }
    out = Py_BuildValue("y#y#", offs.p, (Py_ssize_t)offs.len, data.p ? data.p : "", (Py_ssize_t)data.len);
done:
    PyMem_RawFree(offs.p);
    PyMem_RawFree(data.p);
    return out;
}

static PyMethodDef module_methods[] = {
    {"texts", (PyCFunction)texts, METH_O, "Arrow large_string buffers (offsets, data) of a list of str."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_frames", "Columns straight from log frames (history fold).", -1, module_methods,
};

PyMODINIT_FUNC PyInit__frames(void) {
    if (PyType_Ready(&SinkType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&SinkType);
    if (PyModule_AddObject(m, "Sink", (PyObject *)&SinkType) < 0) {
        Py_DECREF(&SinkType);
        Py_DECREF(m);
        return NULL;
    }
#define KIND(name) if (PyModule_AddIntConstant(m, #name, name) < 0) { Py_DECREF(m); return NULL; }
    KIND(K_INT) KIND(K_FLOAT) KIND(K_STR) KIND(K_BOOL) KIND(K_OPT_INT) KIND(K_OPT_FLOAT) KIND(K_LIST_INT)
    KIND(K_OPT_LIST_INT) KIND(K_CMD) KIND(K_LITERAL) KIND(K_EMPTY_MAP) KIND(K_EMPTY_LIST) KIND(K_STRUCT)
    KIND(K_MAP_STR_STR) KIND(K_MAP_STR_LIST_INT) KIND(K_MAP_INT_INT)
#undef KIND
    /* this build stores int -> int maps (an older one only checks them) */
    if (PyModule_AddIntConstant(m, "STORES_INT_MAPS", 1) < 0) { Py_DECREF(m); return NULL; }
    return m;
}
