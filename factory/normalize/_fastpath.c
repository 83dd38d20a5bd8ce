/* The common records of a file ingest read in C: a fast path in front of the Python one.
 *
 * Parsing a record with orjson builds a Python object for every key and value, the normalizer
 * walks them to build the canonical conversation, and orjson writes it again: most of an
 * ingest's CPU. fast_record(line) reads the line once, in C, into a tape of nodes (no Python
 * object), and gives:
 *
 * - ("call", canonical, messages, tools, model, created, turns, has_tool_calls, provider) for
 *   a logged OpenAI Chat Completions, Anthropic Messages or Gemini generateContent call, or an
 *   OpenAI fine-tuning line, in the shape read here (text, reasoning/thinking, tool calls and
 *   tool results, function tools, one choice or candidate): what openai/anthropic/gemini and
 *   canon.finish would make of it, the canonical messages and tools as their JSON bytes;
 * - ("stream", canonical, collapsed) for a streamed OpenAI call: the line with its "stream"
 *   array's text-only chunks (a single choice whose delta is exactly {"content": a string})
 *   merged, run by run, into one chunk holding their text, every other chunk kept as it is,
 *   the first always. openai.reassemble_stream gives the same response for both (it reads
 *   nothing else of those chunks, and a merged chunk carries the model or created time the
 *   first chunk of its run gave when none was known before). Python normalizes that
 *   (a 16 KB record of ~700 chunk objects becomes a few).
 * - None for anything else, and wherever this is not sure to give what the Python path gives:
 *   text that is not strict JSON, an object with a repeated key (a dict keeps the last
 *   value), a lone surrogate, nesting deeper than MAX_DEPTH, images, content-part lists,
 *   several choices, floats in tool schemas or arguments (the reference encoder writes them
 *   otherwise), any record the Python code would reject (it names the fault). The caller then
 *   reads the line the Python way.
 *
 * "canonical" is orjson.dumps(orjson.loads(line), option=orjson.OPT_SORT_KEYS), the bytes the
 * record's raw_trace_id hashes (compact, keys sorted by their UTF-8 bytes, strings escaped as
 * orjson escapes them); numbers other than short integers are read and written by orjson
 * itself, one at a time. canonical_bytes(line) gives only that; merge_stream(line) gives only
 * the "stream" result (the parse, the canonical bytes and the merge, none of the rules).
 *
 * The rules are the Python normalizers'; this mirrors them for speed. factory.native builds
 * this module with the mypyc-compiled normalizers (``make native``) and uses its rules only
 * while the Python sources are those it was verified against (``factory.native.fastpath``):
 * tests/ingest/test_fastpath.py holds every result to orjson and to the Python path, on
 * variants next to each rule and on mutated records, and a rule changed in Python alone turns
 * this off until those tests pass again.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>
#ifdef __SSE2__
#include <emmintrin.h>
#endif

#define MAX_DEPTH 253 /* containers nested at most 254 deep: orjson.dumps refuses 255 (the
                         Python path then writes with the json module, floats otherwise) */
#define MAX_PLAIN_DIGITS 18 /* an integer of up to 18 digits fits in 64 bits: copied as is */

enum { N_OBJ, N_ARR, N_STR, N_ESTR, N_RAW, N_ARENA };
/* N_STR: a string without escapes (its bytes are the input's).
 * N_ESTR: a string with escapes, decoded (UTF-8) into the arena, escaped again when written.
 * N_RAW: a literal or a short integer, copied from the input.
 * N_ARENA: a number as orjson wrote it, in the arena. */

typedef struct {
    uint8_t type;
    /* 32-bit offsets (a line of 2 GiB or more is not read here): the nodes of a streamed
     * record take half the memory, and it is read faster */
    int32_t start, len; /* string contents / token, in the input or the arena; a container's
                           len is its number of members */
    int32_t src, src_end; /* the whole value's span in the input */
    int32_t next;         /* the node after this one and all it holds */
} Node;

typedef struct {
    unsigned char *data;
    Py_ssize_t len, cap;
} Buf;

typedef struct {
    const unsigned char *base, *p, *end;
    Node *nodes;
    Py_ssize_t n_nodes, cap_nodes;
    Buf arena, out, collapsed, run;
    Buf msgs, tools, tmp; /* an OpenAI call's canonical messages and tools, and scratch */
    Py_ssize_t *members; /* a stack of key nodes: the objects being written, sorted */
    Py_ssize_t n_members, cap_members;
    int error; /* 1: not sure (None); 2: a Python exception is set */
    int cache; /* the buffers are the cached ones (see acquire) */
} State;

static PyObject *orjson_loads, *orjson_dumps;
static void release(State *s);

static int fail(State *s) {
    if (!s->error) s->error = 1;
    return -1;
}

static int grow(void **buf, Py_ssize_t *cap, Py_ssize_t need, size_t item, State *s) {
    if (need <= *cap) return 0;
    Py_ssize_t cap2 = *cap ? *cap : 256;
    while (cap2 < need) cap2 *= 2;
    void *p = PyMem_Realloc(*buf, (size_t)cap2 * item);
    if (!p) {
        PyErr_NoMemory();
        s->error = 2;
        return -1;
    }
    *buf = p;
    *cap = cap2;
    return 0;
}

static inline int reserve(State *s, Buf *b, Py_ssize_t n) {
    return b->len + n <= b->cap ? 0 : grow((void **)&b->data, &b->cap, b->len + n, 1, s);
}

static inline int put(State *s, Buf *b, const void *data, Py_ssize_t n) {
    if (n == 0) return 0; /* (data may be an empty buffer's NULL: no memcpy from it) */
    if (reserve(s, b, n)) return -1;
    memcpy(b->data + b->len, data, (size_t)n);
    b->len += n;
    return 0;
}

static inline int put_byte(State *s, Buf *b, unsigned char c) {
    if (reserve(s, b, 1)) return -1;
    b->data[b->len++] = c;
    return 0;
}

static Py_ssize_t new_node(State *s, uint8_t type, Py_ssize_t start, Py_ssize_t len) {
    /* 32-bit offsets: the line is under 1 GiB, but the numbers orjson writes into the arena
     * can be longer than the line's ("1e15" is "1000000000000000.0") */
    if (start + len > INT32_MAX) return fail(s);
    if (s->n_nodes == s->cap_nodes &&
        grow((void **)&s->nodes, &s->cap_nodes, s->n_nodes + 1, sizeof(Node), s))
        return -1;
    Node *n = &s->nodes[s->n_nodes];
    n->type = type;
    n->start = start;
    n->len = len;
    n->next = s->n_nodes + 1;
    return s->n_nodes++;
}

static inline void skip_ws(State *s) {
    while (s->p < s->end && (*s->p == ' ' || *s->p == '\n' || *s->p == '\r' || *s->p == '\t'))
        s->p++;
}

/* One UTF-8 sequence at p (its first byte >= 0x80): its length, or 0 where it is not valid
 * (overlong, a surrogate, past U+10FFFF, cut short): what orjson refuses. */
static Py_ssize_t utf8_len(const unsigned char *p, const unsigned char *end) {
    unsigned char c = p[0];
    if (c >= 0xC2 && c <= 0xDF) return (end - p >= 2 && (p[1] & 0xC0) == 0x80) ? 2 : 0;
    if (c >= 0xE0 && c <= 0xEF) {
        if (end - p < 3 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80) return 0;
        if (c == 0xE0 && p[1] < 0xA0) return 0;
        if (c == 0xED && p[1] >= 0xA0) return 0;
        return 3;
    }
    if (c >= 0xF0 && c <= 0xF4) {
        if (end - p < 4 || (p[1] & 0xC0) != 0x80 || (p[2] & 0xC0) != 0x80 ||
            (p[3] & 0xC0) != 0x80)
            return 0;
        if (c == 0xF0 && p[1] < 0x90) return 0;
        if (c == 0xF4 && p[1] >= 0x90) return 0;
        return 4;
    }
    return 0;
}

static int hex4(const unsigned char *p, unsigned *value) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        unsigned char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return -1;
    }
    *value = v;
    return 0;
}

static int put_utf8(State *s, unsigned cp) {
    unsigned char b[4];
    Py_ssize_t n;
    if (cp < 0x80) {
        b[0] = (unsigned char)cp;
        n = 1;
    } else if (cp < 0x800) {
        b[0] = (unsigned char)(0xC0 | (cp >> 6));
        b[1] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 2;
    } else if (cp < 0x10000) {
        b[0] = (unsigned char)(0xE0 | (cp >> 12));
        b[1] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        b[2] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 3;
    } else {
        b[0] = (unsigned char)(0xF0 | (cp >> 18));
        b[1] = (unsigned char)(0x80 | ((cp >> 12) & 0x3F));
        b[2] = (unsigned char)(0x80 | ((cp >> 6) & 0x3F));
        b[3] = (unsigned char)(0x80 | (cp & 0x3F));
        n = 4;
    }
    return put(s, &s->arena, b, n);
}

/* A string; s->p is past its opening quote. */
static Py_ssize_t parse_string(State *s) {
    const unsigned char *start = s->p, *p = s->p, *end = s->end;
    int escaped = 0;
    for (;;) {
#ifdef __SSE2__
        /* 16 bytes at a time while none is a quote, a backslash, a control character or
         * non-ASCII (a signed compare: bytes from 0x80 are negative, so "below 0x20" too) */
        const __m128i quote = _mm_set1_epi8('"'), bslash = _mm_set1_epi8('\\'),
                      space = _mm_set1_epi8(0x20);
        while (end - p >= 16) {
            __m128i v = _mm_loadu_si128((const __m128i *)p);
            __m128i m = _mm_or_si128(
                _mm_or_si128(_mm_cmpeq_epi8(v, quote), _mm_cmpeq_epi8(v, bslash)),
                _mm_cmplt_epi8(v, space));
            int mask = _mm_movemask_epi8(m);
            if (mask) {
                p += __builtin_ctz((unsigned)mask);
                break;
            }
            p += 16;
        }
#endif
        if (p >= end) return fail(s);
        unsigned char c = *p;
        if (c == '"') break;
        if (c == '\\') {
            escaped = 1;
            if (end - p < 2) return fail(s);
            p += (p[1] == 'u') ? 6 : 2;
            if (p > end) return fail(s);
            continue;
        }
        if (c < 0x20) return fail(s);
        if (c >= 0x80) {
            Py_ssize_t n = utf8_len(p, end);
            if (!n) return fail(s);
            p += n;
            continue;
        }
        p++;
    }
    s->p = p + 1;
    if (!escaped) return new_node(s, N_STR, start - s->base, p - start);
    /* decode the escapes into the arena */
    Py_ssize_t at = s->arena.len;
    const unsigned char *q = start;
    while (q < p) {
        const unsigned char *run = q;
        while (q < p && *q != '\\') q++;
        if (q > run && put(s, &s->arena, run, q - run)) return -1;
        if (q >= p) break;
        unsigned char one;
        switch (q[1]) {
            case '"': one = '"'; break;
            case '\\': one = '\\'; break;
            case '/': one = '/'; break;
            case 'b': one = '\b'; break;
            case 'f': one = '\f'; break;
            case 'n': one = '\n'; break;
            case 'r': one = '\r'; break;
            case 't': one = '\t'; break;
            case 'u': {
                unsigned cp, low;
                if (hex4(q + 2, &cp)) return fail(s);
                q += 6;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return fail(s); /* a lone low surrogate */
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (p - q < 6 || q[0] != '\\' || q[1] != 'u' || hex4(q + 2, &low) ||
                        low < 0xDC00 || low > 0xDFFF)
                        return fail(s); /* a lone high surrogate */
                    q += 6;
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (low - 0xDC00);
                }
                if (put_utf8(s, cp)) return -1;
                continue;
            }
            default: return fail(s);
        }
        if (put_byte(s, &s->arena, one)) return -1;
        q += 2;
    }
    return new_node(s, N_ESTR, at, s->arena.len - at);
}

/* A number: a short integer is copied; any other is read and written by orjson. */
static Py_ssize_t parse_number(State *s) {
    const unsigned char *start = s->p, *p = s->p, *end = s->end;
    int plain = 1;
    if (p < end && *p == '-') p++;
    const unsigned char *digits = p;
    if (p < end && *p == '0') {
        p++;
    } else if (p < end && *p >= '1' && *p <= '9') {
        while (p < end && *p >= '0' && *p <= '9') p++;
    } else {
        return fail(s);
    }
    if (p - digits > MAX_PLAIN_DIGITS) plain = 0;
    if (p < end && *p == '.') {
        plain = 0;
        p++;
        if (p >= end || *p < '0' || *p > '9') return fail(s);
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    if (p < end && (*p == 'e' || *p == 'E')) {
        plain = 0;
        p++;
        if (p < end && (*p == '+' || *p == '-')) p++;
        if (p >= end || *p < '0' || *p > '9') return fail(s);
        while (p < end && *p >= '0' && *p <= '9') p++;
    }
    s->p = p;
    if (plain && !(p - start == 2 && start[0] == '-' && start[1] == '0'))
        return new_node(s, N_RAW, start - s->base, p - start);
    /* -0 (an integer, written 0), a float, or an integer that may not fit 64 bits */
    PyObject *text = PyBytes_FromStringAndSize((const char *)start, p - start);
    if (!text) {
        s->error = 2;
        return -1;
    }
    PyObject *value = PyObject_CallOneArg(orjson_loads, text);
    Py_DECREF(text);
    if (!value) {
        PyErr_Clear();
        return fail(s);
    }
    PyObject *out = PyObject_CallOneArg(orjson_dumps, value);
    Py_DECREF(value);
    if (!out) {
        PyErr_Clear();
        return fail(s);
    }
    Py_ssize_t at = s->arena.len;
    int bad = put(s, &s->arena, PyBytes_AS_STRING(out), PyBytes_GET_SIZE(out));
    Py_DECREF(out);
    if (bad) return -1;
    return new_node(s, N_ARENA, at, s->arena.len - at);
}

static Py_ssize_t parse_value(State *s, int depth);

static Py_ssize_t parse_container(State *s, int depth, int object) {
    if (depth > MAX_DEPTH) return fail(s);
    Py_ssize_t self = new_node(s, object ? N_OBJ : N_ARR, 0, 0);
    if (self < 0) return -1;
    Py_ssize_t count = 0;
    unsigned char close = object ? '}' : ']';
    s->p++;
    skip_ws(s);
    if (s->p < s->end && *s->p == close) {
        s->p++;
    } else {
        for (;;) {
            if (object) {
                skip_ws(s);
                if (s->p >= s->end || *s->p != '"') return fail(s);
                Py_ssize_t src = s->p - s->base;
                s->p++;
                Py_ssize_t key = parse_string(s);
                if (key < 0) return -1;
                s->nodes[key].src = src;
                s->nodes[key].src_end = s->p - s->base;
                skip_ws(s);
                if (s->p >= s->end || *s->p != ':') return fail(s);
                s->p++;
            }
            if (parse_value(s, depth + 1) < 0) return -1;
            count++;
            skip_ws(s);
            if (s->p >= s->end) return fail(s);
            if (*s->p == ',') {
                s->p++;
                continue;
            }
            if (*s->p == close) {
                s->p++;
                break;
            }
            return fail(s);
        }
    }
    s->nodes[self].len = count;
    s->nodes[self].next = s->n_nodes;
    return self;
}

static Py_ssize_t parse_value(State *s, int depth) {
    skip_ws(s);
    if (s->p >= s->end) return fail(s);
    Py_ssize_t src = s->p - s->base, node;
    unsigned char c = *s->p;
    if (c == '{' || c == '[') {
        node = parse_container(s, depth, c == '{');
    } else if (c == '"') {
        s->p++;
        node = parse_string(s);
    } else if (c == '-' || (c >= '0' && c <= '9')) {
        node = parse_number(s);
    } else if (s->end - s->p >= 4 && memcmp(s->p, "true", 4) == 0) {
        s->p += 4;
        node = new_node(s, N_RAW, src, 4);
    } else if (s->end - s->p >= 5 && memcmp(s->p, "false", 5) == 0) {
        s->p += 5;
        node = new_node(s, N_RAW, src, 5);
    } else if (s->end - s->p >= 4 && memcmp(s->p, "null", 4) == 0) {
        s->p += 4;
        node = new_node(s, N_RAW, src, 4);
    } else {
        return fail(s);
    }
    if (node < 0) return -1;
    s->nodes[node].src = src;
    s->nodes[node].src_end = s->p - s->base;
    return node;
}

/* -- canonical bytes ------------------------------------------------------------------------ */
static inline const unsigned char *str_bytes(State *s, const Node *n) {
    return n->type == N_STR ? s->base + n->start : s->arena.data + n->start;
}

static int key_cmp(State *s, Py_ssize_t a, Py_ssize_t b) {
    const Node *na = &s->nodes[a], *nb = &s->nodes[b];
    const unsigned char *ka = str_bytes(s, na), *kb = str_bytes(s, nb);
    Py_ssize_t n = na->len < nb->len ? na->len : nb->len;
    for (Py_ssize_t i = 0; i < n; i++) /* keys are short: no call to memcmp */
        if (ka[i] != kb[i]) return ka[i] < kb[i] ? -1 : 1;
    return na->len < nb->len ? -1 : (na->len > nb->len ? 1 : 0);
}

static const char HEX[] = "0123456789abcdef";

/* ``data`` as the contents of a JSON string, escaped as orjson escapes (", \ and control
 * characters, nothing else). */
static int write_escaped(State *s, Buf *b, const unsigned char *p, Py_ssize_t len) {
    if (len == 0) return 0; /* (p may be an empty buffer's NULL) */
    if (reserve(s, b, len * 6)) return -1;
    unsigned char *o = b->data + b->len;
    const unsigned char *end = p + len;
    for (; p < end; p++) {
        unsigned char c = *p;
        if (c == '"' || c == '\\') {
            *o++ = '\\';
            *o++ = c;
        } else if (c < 0x20) {
            *o++ = '\\';
            switch (c) {
                case '\b': *o++ = 'b'; break;
                case '\t': *o++ = 't'; break;
                case '\n': *o++ = 'n'; break;
                case '\f': *o++ = 'f'; break;
                case '\r': *o++ = 'r'; break;
                default:
                    *o++ = 'u';
                    *o++ = '0';
                    *o++ = '0';
                    *o++ = (unsigned char)HEX[c >> 4];
                    *o++ = (unsigned char)HEX[c & 15];
            }
        } else {
            *o++ = c;
        }
    }
    b->len = o - b->data;
    return 0;
}

static int write_string(State *s, Buf *b, const Node *n) {
    if (n->type == N_STR) { /* its bytes in the input are already escaped that way */
        if (reserve(s, b, n->len + 2)) return -1;
        b->data[b->len++] = '"';
        memcpy(b->data + b->len, s->base + n->start, (size_t)n->len);
        b->len += n->len;
        b->data[b->len++] = '"';
        return 0;
    }
    return put_byte(s, b, '"') || write_escaped(s, b, s->arena.data + n->start, n->len) ||
           put_byte(s, b, '"');
}

enum {
    F_LOWER = 1,   /* a JSON Schema: upper-case type names lower-cased (lower_schema_types) */
    F_NOFLOAT = 2, /* refuse numbers orjson writes (the reference encoder may differ) */
};

static inline int is_string(const Node *n) { return n->type == N_STR || n->type == N_ESTR; }

static int str_is(State *s, const Node *n, const char *text) {
    size_t len = strlen(text);
    return is_string(n) && (size_t)n->len == len && memcmp(str_bytes(s, n), text, len) == 0;
}

static const char *const SCHEMA_TYPES[] = {"STRING", "NUMBER", "INTEGER", "BOOLEAN", "ARRAY",
                                           "OBJECT", "NULL", NULL};
static const char *const USER_DATA[] = {"enum", "const", "default", "example", "examples", NULL};

static int str_in(State *s, const Node *n, const char *const *set) {
    for (; *set; set++)
        if (str_is(s, n, *set)) return 1;
    return 0;
}

/* A string, lower-cased when it is an OpenAPI type name (``STRING``). */
static int write_type_name(State *s, Buf *b, const Node *n) {
    if (!str_in(s, n, SCHEMA_TYPES)) return write_string(s, b, n);
    if (reserve(s, b, n->len + 2)) return -1;
    const unsigned char *t = str_bytes(s, n);
    b->data[b->len++] = '"';
    for (Py_ssize_t i = 0; i < n->len; i++) b->data[b->len++] = (unsigned char)(t[i] | 0x20);
    b->data[b->len++] = '"';
    return 0;
}

static int write_value(State *s, Buf *b, Py_ssize_t index, int flags) {
    const Node *n = &s->nodes[index];
    switch (n->type) {
        case N_STR:
        case N_ESTR: return write_string(s, b, n);
        case N_RAW: return put(s, b, s->base + n->start, n->len);
        case N_ARENA:
            if (flags & F_NOFLOAT) return fail(s);
            return put(s, b, s->arena.data + n->start, n->len);
        case N_ARR: {
            if (put_byte(s, b, '[')) return -1;
            Py_ssize_t child = index + 1, count = n->len;
            for (Py_ssize_t i = 0; i < count; i++) {
                if (i && put_byte(s, b, ',')) return -1;
                if (write_value(s, b, child, flags)) return -1;
                child = s->nodes[child].next;
            }
            return put_byte(s, b, ']');
        }
        case N_OBJ: {
            Py_ssize_t count = n->len, base = s->n_members;
            if (grow((void **)&s->members, &s->cap_members, base + count, sizeof(Py_ssize_t), s))
                return -1;
            /* the keys, insertion-sorted (objects are small, and often sorted already) */
            Py_ssize_t *m = s->members + base, key = index + 1;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t j = i;
                int c = 1;
                while (j > 0 && (c = key_cmp(s, m[j - 1], key)) > 0) {
                    m[j] = m[j - 1];
                    j--;
                }
                if (j > 0 && c == 0) return fail(s); /* a repeated key */
                m[j] = key;
                key = s->nodes[key + 1].next; /* past the key and its value */
            }
            s->n_members = base + count;
            if (put_byte(s, b, '{')) return -1;
            for (Py_ssize_t i = 0; i < count; i++) {
                Py_ssize_t k = s->members[base + i];
                const Node *v = &s->nodes[k + 1];
                if ((i && put_byte(s, b, ',')) || write_string(s, b, &s->nodes[k]) ||
                    put_byte(s, b, ':'))
                    return -1;
                int vflags = flags, done = 0;
                if ((flags & F_LOWER) && str_is(s, &s->nodes[k], "type")) {
                    if (is_string(v)) {
                        if (write_type_name(s, b, v)) return -1;
                        done = 1;
                    } else if (v->type == N_ARR) { /* names lowered, anything else as is */
                        if (put_byte(s, b, '[')) return -1;
                        Py_ssize_t item = k + 2;
                        for (Py_ssize_t j = 0; j < v->len; j++) {
                            if (j && put_byte(s, b, ',')) return -1;
                            if (is_string(&s->nodes[item]) ? write_type_name(s, b, &s->nodes[item])
                                : write_value(s, b, item, flags & ~F_LOWER))
                                return -1;
                            item = s->nodes[item].next;
                        }
                        if (put_byte(s, b, ']')) return -1;
                        done = 1;
                    }
                } else if ((flags & F_LOWER) && str_in(s, &s->nodes[k], USER_DATA)) {
                    vflags &= ~F_LOWER; /* user data inside a schema: as it is */
                }
                if (!done && write_value(s, b, k + 1, vflags)) return -1;
            }
            s->n_members = base;
            return put_byte(s, b, '}');
        }
    }
    return fail(s);
}

/* -- the stream ------------------------------------------------------------------------------ */
/* The value node of ``key`` in object node ``obj``, or -1. */
static Py_ssize_t member(State *s, Py_ssize_t obj, const char *key) {
    Py_ssize_t len = (Py_ssize_t)strlen(key), k = obj + 1;
    for (Py_ssize_t i = 0; i < s->nodes[obj].len; i++) {
        const Node *n = &s->nodes[k];
        if (n->len == len && memcmp(str_bytes(s, n), key, (size_t)len) == 0) return k + 1;
        k = s->nodes[k + 1].next;
    }
    return -1;
}

/* Python's truth of a value: 1, 0, or -1 where this does not know it (a float). */
static int truth(State *s, Py_ssize_t index) {
    const Node *n = &s->nodes[index];
    switch (n->type) {
        case N_STR:
        case N_ESTR:
        case N_OBJ:
        case N_ARR: return n->len > 0;
        case N_RAW: {
            const unsigned char *t = s->base + n->start;
            if (t[0] == 'f' || t[0] == 'n') return 0; /* false, null */
            if (t[0] == 't') return 1;
            return !(n->len == 1 && t[0] == '0'); /* an integer (-0 is N_ARENA) */
        }
    }
    return -1;
}

typedef struct {
    Py_ssize_t index;  /* the choice's index token (a node), or -1: none, which reads as 0 */
    Py_ssize_t text;   /* the delta's content (a string node) */
    Py_ssize_t model, created; /* the chunk's, or -1 */
} Piece;

/* Whether chunk node ``c`` only adds text to one choice (see the top), and its parts. */
static int only_text(State *s, Py_ssize_t c, Piece *piece) {
    if (s->nodes[c].type != N_OBJ || member(s, c, "error") >= 0) return 0;
    Py_ssize_t choices = member(s, c, "choices");
    if (choices < 0 || s->nodes[choices].type != N_ARR || s->nodes[choices].len != 1) return 0;
    Py_ssize_t choice = choices + 1;
    if (s->nodes[choice].type != N_OBJ) return 0;
    Py_ssize_t delta = member(s, choice, "delta");
    if (delta < 0 || s->nodes[delta].type != N_OBJ || s->nodes[delta].len != 1) return 0;
    Py_ssize_t text = member(s, delta, "content");
    if (text < 0 || (s->nodes[text].type != N_STR && s->nodes[text].type != N_ESTR)) return 0;
    Py_ssize_t index = member(s, choice, "index");
    if (index >= 0) { /* an integer (a bool is not one here: Python's check is type() is int) */
        const Node *n = &s->nodes[index];
        if (n->type != N_RAW) return 0; /* (a float, a string: their start is in the arena) */
        unsigned char t = s->base[n->start];
        if (!(t == '-' || (t >= '0' && t <= '9'))) return 0;
    }
    piece->index = index;
    piece->text = text;
    piece->model = member(s, c, "model");
    piece->created = member(s, c, "created");
    return 1;
}

static int same_index(State *s, Py_ssize_t a, Py_ssize_t b) {
    const Node *na = a >= 0 ? &s->nodes[a] : NULL, *nb = b >= 0 ? &s->nodes[b] : NULL;
    const unsigned char *ta = na ? s->base + na->start : (const unsigned char *)"0";
    const unsigned char *tb = nb ? s->base + nb->start : (const unsigned char *)"0";
    Py_ssize_t la = na ? na->len : 1, lb = nb ? nb->len : 1;
    return la == lb && memcmp(ta, tb, (size_t)la) == 0;
}

static int put_src(State *s, Buf *b, Py_ssize_t node) {
    const Node *n = &s->nodes[node];
    return put(s, b, s->base + n->src, n->src_end - n->src);
}

/* One more element of the collapsed stream: a comma before all but the first. */
static int element(State *s, int *written) {
    return (*written)++ ? put_byte(s, &s->collapsed, ',') : 0;
}

/* The merged chunk of a run, if one is open: its model and created time (where the run's
 * first chunk gave ones that are read), its choice's index and the text of all its chunks. */
static int flush(State *s, Piece *run, int *written) {
    Buf *b = &s->collapsed;
    if (run->text < 0) return 0;
    if (element(s, written) || put_byte(s, b, '{')) return -1;
    if (run->model >= 0 &&
        (put(s, b, "\"model\":", 8) || put_src(s, b, run->model) || put_byte(s, b, ',')))
        return -1;
    if (run->created >= 0 &&
        (put(s, b, "\"created\":", 10) || put_src(s, b, run->created) || put_byte(s, b, ',')))
        return -1;
    if (put(s, b, "\"choices\":[{\"index\":", 20)) return -1;
    if (run->index >= 0 ? put_src(s, b, run->index) : put_byte(s, b, '0')) return -1;
    if (put(s, b, ",\"delta\":{\"content\":\"", 21) || put(s, b, s->run.data, s->run.len) ||
        put(s, b, "\"}}]}", 5))
        return -1;
    s->run.len = 0;
    run->text = -1;
    return 0;
}

/* What reassemble_stream reads of a chunk's model or created time: whether it is known (true)
 * after this chunk; -1 where this cannot tell (a float). */
static int learn(State *s, Py_ssize_t value, int *known) {
    if (*known || value < 0) return 0;
    int t = truth(s, value);
    if (t < 0) return -1;
    *known = t;
    return 0;
}

/* The line with its stream's text-only chunks merged (see the top) into s->collapsed: 0, 1
 * when there is nothing to collapse or this cannot be sure, -1 on an error. */
static int collapse(State *s) {
    if (s->nodes[0].type != N_OBJ) return 1;
    Py_ssize_t stream = member(s, 0, "stream");
    if (stream < 0 || s->nodes[stream].type != N_ARR || s->nodes[stream].len < 3) return 1;
    Buf *b = &s->collapsed;
    const Node *sn = &s->nodes[stream];
    if (put(s, b, s->base, sn->src) || put_byte(s, b, '[')) return -1;
    int model_known = 0, created_known = 0, written = 0, merges = 0;
    Piece run = {-1, -1, -1, -1}, piece;
    Py_ssize_t chunk = stream + 1, count = sn->len;
    for (Py_ssize_t i = 0; i < count; i++, chunk = s->nodes[chunk].next) {
        if (i > 0 && only_text(s, chunk, &piece)) {
            /* a chunk whose model or created time is read starts a run of its own */
            int reads = (!model_known && piece.model >= 0) ||
                        (!created_known && piece.created >= 0);
            if (run.text >= 0 && (reads || !same_index(s, run.index, piece.index))) {
                if (flush(s, &run, &written)) return -1;
            }
            if (run.text < 0) {
                run = piece;
                if (!model_known && piece.model >= 0) {
                    if (learn(s, piece.model, &model_known)) return 1;
                } else {
                    run.model = -1;
                }
                if (!created_known && piece.created >= 0) {
                    if (learn(s, piece.created, &created_known)) return 1;
                } else {
                    run.created = -1;
                }
            } else {
                merges++;
            }
            const Node *t = &s->nodes[piece.text];
            if (put(s, &s->run, s->base + t->src + 1, t->src_end - t->src - 2)) return -1;
            continue;
        }
        if (flush(s, &run, &written) || element(s, &written) || put_src(s, b, chunk)) return -1;
        if (s->nodes[chunk].type == N_OBJ &&
            (learn(s, member(s, chunk, "model"), &model_known) ||
             learn(s, member(s, chunk, "created"), &created_known)))
            return 1;
    }
    if (flush(s, &run, &written)) return -1;
    if (!merges) return 1; /* nothing gained */
    if (put_byte(s, b, ']') || put(s, b, s->base + sn->src_end, (s->end - s->base) - sn->src_end))
        return -1;
    return 0;
}

/* -- logged OpenAI calls ------------------------------------------------------------------- */
/* A logged Chat Completions call ({"request", "response"}) normalized here, as
 * factory.normalize.openai.normalize_call and canon.finish would: the canonical messages and
 * tools (their JSON), model, created time, turns and whether it calls tools. Only the common
 * shape: text content (a string or nothing), tool calls and tool results, function tools, one
 * choice. Anything else (images, content parts, legacy functions, a prefilled assistant turn,
 * several choices, floats in tool schemas or arguments, anything the Python code would
 * reject) returns "not sure", and the Python path reads the record. */

#define MAX_CALLS 256

typedef struct {
    const unsigned char *id; /* the provisional id (decoded), or NULL */
    Py_ssize_t id_len;
    int number;              /* its canonical id: call_<number> */
} IdMap;

typedef struct {
    int number;               /* call_<number> */
    const unsigned char *name;
    Py_ssize_t name_len;
} Pending;

typedef struct {
    IdMap ids[MAX_CALLS];
    int n_ids;
    Pending pending[MAX_CALLS];
    int n_pending;
    int num_calls, num_assistant, has_tool_calls, num_messages;
    int last_plain_assistant; /* the last message is an assistant turn without tool calls */
} Finish;

static int put_call_id(State *s, Buf *b, int number) {
    char text[32];
    int n = snprintf(text, sizeof(text), "\"call_%d\"", number);
    return put(s, b, text, n);
}

/* Absent or null (what ``.get`` reads as None). */
static int is_null(State *s, Py_ssize_t node) {
    return node < 0 || (s->nodes[node].type == N_RAW && s->base[s->nodes[node].start] == 'n');
}

/* canon_json_text of a string node into s->tmp (unescaped): the canonical JSON of an object
 * or array it holds, else the string itself. 0, or 1: not sure (the caller gives up). */
static int json_text(State *s, const Node *n) {
    const unsigned char *text = str_bytes(s, n);
    Py_ssize_t len = n->len;
    s->tmp.len = 0;
    if (len && (text[0] == '{' || text[0] == '[')) {
        State sub;
        memset(&sub, 0, sizeof(sub));
        sub.base = sub.p = text;
        sub.end = text + len;
        int bad = parse_value(&sub, 0) < 0;
        if (!bad) {
            skip_ws(&sub);
            bad = sub.p != sub.end || write_value(&sub, &s->tmp, 0, F_NOFLOAT) != 0;
        }
        int error = sub.error;
        release(&sub);
        if (error == 2) s->error = 2;
        return bad ? 1 : 0;
    }
    /* Python strips leading whitespace (any Unicode space) before looking: not here */
    if (len && (text[0] >= 0x80 || text[0] == ' ' || (text[0] >= 0x09 && text[0] <= 0x0d) ||
                (text[0] >= 0x1c && text[0] <= 0x1f)))
        return 1;
    return put(s, &s->tmp, text, len) ? 1 : 0;
}

/* One text part (a text one dropped when empty, as finish drops it; a reasoning one is kept),
 * with a comma before all but the first part of its message. */
static int text_part(State *s, const Node *text, const char *type, int *parts) {
    if (text->len == 0 && type[0] == 't') return 0;
    Buf *b = &s->msgs;
    if ((*parts)++ && put_byte(s, b, ',')) return -1;
    return put(s, b, "{\"text\":", 8) || write_string(s, b, text) ||
           put(s, b, ",\"type\":\"", 9) || put(s, b, type, (Py_ssize_t)strlen(type)) ||
           put(s, b, "\"}", 2);
}

/* A part whose text is in s->tmp (a tool result): the same, escaped from there. */
static int tmp_part(State *s, int *parts) {
    if (s->tmp.len == 0) return 0;
    Buf *b = &s->msgs;
    if ((*parts)++ && put_byte(s, b, ',')) return -1;
    return put(s, b, "{\"text\":\"", 9) || write_escaped(s, b, s->tmp.data, s->tmp.len) ||
           put(s, b, "\",\"type\":\"text\"}", 16);
}

static int begin_message(State *s, Finish *f) {
    Buf *b = &s->msgs;
    if (f->num_messages++ && put_byte(s, b, ',')) return -1;
    return put(s, b, "{\"content\":[", 12);
}

static int end_message(State *s, const char *role) {
    Buf *b = &s->msgs;
    return put(s, b, "],\"role\":\"", 10) || put(s, b, role, (Py_ssize_t)strlen(role)) ||
           put_byte(s, b, '"');
}

/* One canonical tool call (finish renumbers it), its arguments' text in s->tmp: with a comma
 * before all but the first (j). ``id``: its provisional id node (a string), or -1. */
static int emit_call(State *s, Finish *f, Py_ssize_t j, Py_ssize_t id, Py_ssize_t name) {
    Buf *b = &s->msgs;
    int number = f->num_calls++;
    if (id >= 0 && s->nodes[id].len) { /* "" reads as no id */
        if (f->n_ids == MAX_CALLS) return 1;
        f->ids[f->n_ids].id = str_bytes(s, &s->nodes[id]);
        f->ids[f->n_ids].id_len = s->nodes[id].len;
        f->ids[f->n_ids++].number = number;
    }
    if (f->n_pending == MAX_CALLS) return 1;
    f->pending[f->n_pending].number = number;
    f->pending[f->n_pending].name = str_bytes(s, &s->nodes[name]);
    f->pending[f->n_pending++].name_len = s->nodes[name].len;
    if ((j && put_byte(s, b, ',')) || put(s, b, "{\"arguments\":\"", 14) ||
        write_escaped(s, b, s->tmp.data, s->tmp.len) || put(s, b, "\",\"id\":", 7) ||
        put_call_id(s, b, number) || put(s, b, ",\"name\":", 8) ||
        write_string(s, b, &s->nodes[name]) || put_byte(s, b, '}'))
        return -1;
    return 0;
}

/* Which call a tool result answers (finish): by its provisional id, else by name among the
 * calls not answered yet, else the first of those when it names neither, else a new number. */
static int answer(Finish *f, const unsigned char *pid, Py_ssize_t pid_len,
                  const unsigned char *nm, Py_ssize_t nm_len) {
    int cid = -1;
    if (pid)
        for (int i = f->n_ids - 1; i >= 0; i--) /* the latest: a dict's last assignment */
            if (f->ids[i].id_len == pid_len && memcmp(f->ids[i].id, pid, (size_t)pid_len) == 0) {
                cid = f->ids[i].number;
                break;
            }
    if (cid < 0) {
        int match = -1;
        if (nm)
            for (int i = 0; i < f->n_pending; i++)
                if (f->pending[i].name_len == nm_len &&
                    memcmp(f->pending[i].name, nm, (size_t)nm_len) == 0) {
                    match = f->pending[i].number;
                    break;
                }
        if (match >= 0) {
            cid = match;
        } else if (!pid && f->n_pending && !nm) {
            cid = f->pending[0].number;
        } else {
            cid = f->num_calls++;
            if (pid) {
                if (f->n_ids == MAX_CALLS) return -1;
                f->ids[f->n_ids].id = pid;
                f->ids[f->n_ids].id_len = pid_len;
                f->ids[f->n_ids++].number = cid;
            }
        }
    }
    int kept = 0;
    for (int i = 0; i < f->n_pending; i++)
        if (f->pending[i].number != cid) f->pending[kept++] = f->pending[i];
    f->n_pending = kept;
    f->last_plain_assistant = 0;
    return cid;
}

/* A tool result: its message, with the call it answers (finish's matching). 0, 1 (not
 * sure) or -1. */
static int tool_result(State *s, Finish *f, Py_ssize_t msg, int is_tool_role) {
    Py_ssize_t content = member(s, msg, "content"), name = member(s, msg, "name");
    Py_ssize_t call_id = member(s, msg, "tool_call_id");
    if (content < 0 || !is_string(&s->nodes[content])) return 1;
    const Node *nn = name >= 0 && is_string(&s->nodes[name]) ? &s->nodes[name] : NULL;
    const Node *pid = NULL;
    if (is_null(s, call_id)) call_id = -1;
    if (call_id >= 0) {
        if (!is_string(&s->nodes[call_id])) return 1; /* (a number: str() of it) */
        if (s->nodes[call_id].len) pid = &s->nodes[call_id]; /* "" reads as none */
    }
    if (is_tool_role && call_id < 0 && !nn) return 1; /* Python rejects it */
    if (json_text(s, &s->nodes[content])) return 1;
    int parts = 0;
    if (begin_message(s, f) || tmp_part(s, &parts) || end_message(s, "tool")) return -1;
    /* which call it answers */
    const unsigned char *nm = nn && nn->len ? str_bytes(s, nn) : NULL; /* finish: _name if name */
    int cid = answer(f, pid ? str_bytes(s, pid) : NULL, pid ? pid->len : 0, nm, nm ? nn->len : 0);
    if (cid < 0) return 1;
    return put(s, &s->msgs, ",\"tool_call_id\":", 16) || put_call_id(s, &s->msgs, cid) ||
           put_byte(s, &s->msgs, '}') ? -1 : 0;
}

/* An assistant turn (_message): reasoning, content, refusal, tool calls. 0, 1 or -1. */
static int assistant(State *s, Finish *f, Py_ssize_t msg) {
    if (!is_null(s, member(s, msg, "function_call"))) return 1;
    Py_ssize_t reasoning = member(s, msg, "reasoning_content");
    Py_ssize_t content = member(s, msg, "content"), refusal = member(s, msg, "refusal");
    Py_ssize_t calls = member(s, msg, "tool_calls");
    int null_content = is_null(s, content);
    if (!null_content && !is_string(&s->nodes[content])) return 1;
    int null_refusal = is_null(s, refusal);
    if (!null_refusal && !is_string(&s->nodes[refusal])) return 1;
    int null_calls = is_null(s, calls);
    if (!null_calls && s->nodes[calls].type != N_ARR) return 1;
    int parts = 0;
    if (begin_message(s, f)) return -1;
    if (reasoning >= 0 && is_string(&s->nodes[reasoning]) && s->nodes[reasoning].len &&
        text_part(s, &s->nodes[reasoning], "reasoning", &parts))
        return -1;
    if (!null_content && text_part(s, &s->nodes[content], "text", &parts)) return -1;
    if (!null_refusal && text_part(s, &s->nodes[refusal], "text", &parts)) return -1;
    if (end_message(s, "assistant")) return -1;
    f->num_assistant++;
    Py_ssize_t count = null_calls ? 0 : s->nodes[calls].len;
    if (count) {
        Buf *b = &s->msgs;
        if (put(s, b, ",\"tool_calls\":[", 15)) return -1;
        Py_ssize_t call = calls + 1;
        for (Py_ssize_t j = 0; j < count; j++, call = s->nodes[call].next) {
            if (s->nodes[call].type != N_OBJ) return 1;
            Py_ssize_t type = member(s, call, "type"), fn = member(s, call, "function");
            Py_ssize_t id = member(s, call, "id");
            if (type >= 0 && !str_is(s, &s->nodes[type], "function")) return 1;
            if (fn < 0 || s->nodes[fn].type != N_OBJ) return 1;
            Py_ssize_t name = member(s, fn, "name"), args = member(s, fn, "arguments");
            if (name < 0 || !is_string(&s->nodes[name]) || !s->nodes[name].len) return 1;
            if (is_null(s, id)) id = -1;
            if (id >= 0 && !is_string(&s->nodes[id])) return 1; /* (a number: str() of it) */
            /* the arguments, canonical where JSON (canon_json_text) */
            if (is_null(s, args)) {
                s->tmp.len = 0;
                if (put(s, &s->tmp, "{}", 2)) return -1;
            } else if (is_string(&s->nodes[args])) {
                if (json_text(s, &s->nodes[args])) return 1;
            } else if (s->nodes[args].type == N_OBJ || s->nodes[args].type == N_ARR) {
                s->tmp.len = 0;
                if (write_value(s, &s->tmp, args, F_NOFLOAT)) return s->error == 2 ? -1 : 1;
            } else {
                return 1;
            }
            int done = emit_call(s, f, j, id, name);
            if (done) return done;
        }
        if (put_byte(s, b, ']')) return -1;
        f->has_tool_calls = 1;
    }
    f->last_plain_assistant = count == 0;
    return put_byte(s, &s->msgs, '}') ? -1 : 0;
}

/* One request message (convert_messages, then finish). 0, 1 or -1. */
static int request_message(State *s, Finish *f, Py_ssize_t msg) {
    if (s->nodes[msg].type != N_OBJ) return 1;
    Py_ssize_t role = member(s, msg, "role");
    if (role < 0) return 1;
    const Node *r = &s->nodes[role];
    const char *canon;
    if (str_is(s, r, "system") || str_is(s, r, "developer")) canon = "system";
    else if (str_is(s, r, "user")) canon = "user";
    else if (str_is(s, r, "assistant")) return assistant(s, f, msg);
    else if (str_is(s, r, "tool")) return tool_result(s, f, msg, 1);
    else if (str_is(s, r, "function")) return tool_result(s, f, msg, 0);
    else return 1;
    Py_ssize_t content = member(s, msg, "content");
    int parts = 0;
    if (!is_null(s, content) && !is_string(&s->nodes[content])) return 1; /* parts, images */
    if (begin_message(s, f) ||
        (!is_null(s, content) && text_part(s, &s->nodes[content], "text", &parts)) ||
        end_message(s, canon) || put_byte(s, &s->msgs, '}'))
        return -1;
    f->last_plain_assistant = 0;
    return 0;
}

/* One canonical tool (tool_def) into s->tools, with a comma before all but the first (i):
 * exactly its name, description and parameters (upper-case type names lowered). */
static int write_tool(State *s, Py_ssize_t i, Py_ssize_t name, Py_ssize_t desc,
                      Py_ssize_t params) {
    Buf *b = &s->tools;
    if (name < 0 || !is_string(&s->nodes[name]) || !s->nodes[name].len) return 1;
    if (!is_null(s, desc) && !is_string(&s->nodes[desc])) return 1;
    if (!is_null(s, params) && s->nodes[params].type != N_OBJ) return 1; /* (text: parsed) */
    if ((i && put_byte(s, b, ',')) || put(s, b, "{\"description\":", 15) ||
        (is_null(s, desc) ? put(s, b, "\"\"", 2) : write_string(s, b, &s->nodes[desc])) ||
        put(s, b, ",\"name\":", 8) || write_string(s, b, &s->nodes[name]) ||
        put(s, b, ",\"parameters\":", 14))
        return -1;
    if (is_null(s, params)) {
        if (put(s, b, "{}", 2)) return -1;
    } else if (write_value(s, b, params, F_LOWER | F_NOFLOAT)) {
        return s->error == 2 ? -1 : 1;
    }
    return put_byte(s, b, '}') ? -1 : 0;
}

/* The tools (convert_tools, tool_def) into s->tools: OpenAI's ({"type": "function",
 * "function": {name, description, parameters}}) or Anthropic's ({name, description,
 * input_schema}). 0, 1 or -1. */
static int request_tools(State *s, Py_ssize_t request, int anthropic) {
    Buf *b = &s->tools;
    if (!anthropic && !is_null(s, member(s, request, "functions"))) return 1;
    Py_ssize_t tools = member(s, request, "tools");
    if (put_byte(s, b, '[')) return -1;
    if (!is_null(s, tools)) {
        if (s->nodes[tools].type != N_ARR) return 1;
        Py_ssize_t tool = tools + 1;
        for (Py_ssize_t i = 0; i < s->nodes[tools].len; i++, tool = s->nodes[tool].next) {
            if (s->nodes[tool].type != N_OBJ) return 1;
            Py_ssize_t fn = tool;
            if (!anthropic) {
                Py_ssize_t type = member(s, tool, "type");
                fn = member(s, tool, "function");
                if (type >= 0 && !str_is(s, &s->nodes[type], "function")) return 1;
                if (fn < 0 || s->nodes[fn].type != N_OBJ) return 1;
            }
            Py_ssize_t name = member(s, fn, "name"), desc = member(s, fn, "description");
            Py_ssize_t params = member(s, fn, anthropic ? "input_schema" : "parameters");
            int done = write_tool(s, i, name, desc, params);
            if (done) return done;
        }
    }
    return put_byte(s, b, ']');
}

static int anthropic_turn(State *s, Finish *f, Py_ssize_t content, int is_assistant);
static int text_message(State *s, Finish *f, const Node *text, const char *role);
static int anthropic_request(State *s, Finish *f, Py_ssize_t request);

typedef struct {
    const char *provider;
    Py_ssize_t model;   /* the model's string node, or -1: none */
    const unsigned char *model_text; /* or its text, where not a whole node (Gemini's) */
    Py_ssize_t model_len;
    Py_ssize_t created; /* the response's created node, or -1 */
    Finish f;
} Call;

/* _call's checks of a logged call: status 200, not partial. */
static int completed(State *s) {
    Py_ssize_t status = member(s, 0, "status"), partial = member(s, 0, "partial");
    if (status >= 0 && !(s->nodes[status].type == N_RAW && s->nodes[status].len == 3 &&
                         memcmp(s->base + s->nodes[status].start, "200", 3) == 0))
        return 0;
    if (partial >= 0 && !is_null(s, partial) &&
        !(s->nodes[partial].type == N_RAW && s->base[s->nodes[partial].start] == 'f'))
        return 0;
    return 1;
}

/* The model: the response's if it has one (truthy), else the request's; -1: none, -2: not
 * sure. */
static Py_ssize_t call_model(State *s, Py_ssize_t response, Py_ssize_t request) {
    Py_ssize_t model = member(s, response, "model");
    int t = model >= 0 ? truth(s, model) : 0;
    if (t < 0) return -2;
    if (!t) model = member(s, request, "model");
    return model >= 0 && is_string(&s->nodes[model]) ? model : -1;
}

/* The "messages" of ``body`` (convert_messages, then finish) opening s->msgs: 0, 1 or -1. */
static int openai_messages(State *s, Finish *f, Py_ssize_t body) {
    Py_ssize_t messages = member(s, body, "messages");
    if (messages < 0 || s->nodes[messages].type != N_ARR) return 1;
    memset(f, 0, sizeof(*f));
    if (put_byte(s, &s->msgs, '[')) return -1;
    Py_ssize_t msg = messages + 1;
    for (Py_ssize_t i = 0; i < s->nodes[messages].len; i++, msg = s->nodes[msg].next) {
        int done = request_message(s, f, msg);
        if (done) return done;
    }
    return 0;
}

/* A logged OpenAI call (see the top of this part) into s->msgs and s->tools. 0, 1 (not
 * sure, or not such a call) or -1. */
static int openai_call(State *s, Call *call) {
    Py_ssize_t request = member(s, 0, "request"), response = member(s, 0, "response");
    if (s->nodes[request].type != N_OBJ) return 1;
    if (!completed(s)) return 1;
    /* the response: one choice, an assistant message */
    if (member(s, response, "error") >= 0) return 1;
    Py_ssize_t choices = member(s, response, "choices");
    if (choices < 0 || s->nodes[choices].type != N_ARR || s->nodes[choices].len != 1) return 1;
    Py_ssize_t choice = choices + 1;
    if (s->nodes[choice].type != N_OBJ) return 1;
    Py_ssize_t reply = member(s, choice, "message");
    if (reply < 0 || s->nodes[reply].type != N_OBJ) return 1;
    Py_ssize_t role = member(s, reply, "role");
    if (role >= 0 && !str_is(s, &s->nodes[role], "assistant")) return 1;
    /* the request's conversation */
    Finish *f = &call->f;
    int done = openai_messages(s, f, request);
    if (done) return done;
    if (f->last_plain_assistant) return 1; /* a prefill: the reply continues it */
    done = request_tools(s, request, 0);
    if (done) return done;
    done = assistant(s, f, reply);
    if (done) return done;
    if (put_byte(s, &s->msgs, ']')) return -1;
    call->model = call_model(s, response, request);
    if (call->model == -2) return 1;
    call->created = member(s, response, "created");
    call->provider = "openai";
    return 0;
}

/* A logged Anthropic Messages call (anthropic.normalize_call, then finish), in the shape read
 * here: text, thinking, tool use and tool results, tools. 0, 1 or -1. */
static int anthropic_call(State *s, Call *call) {
    Py_ssize_t request = member(s, 0, "request"), response = member(s, 0, "response");
    if (request < 0 || response < 0 || s->nodes[request].type != N_OBJ ||
        s->nodes[response].type != N_OBJ || !completed(s))
        return 1;
    Py_ssize_t type = member(s, response, "type"), role = member(s, response, "role");
    Py_ssize_t content = member(s, response, "content");
    if (type >= 0 && str_is(s, &s->nodes[type], "error")) return 1;
    if (role >= 0 && !str_is(s, &s->nodes[role], "assistant")) return 1;
    if (content < 0) return 1;
    Finish *f = &call->f;
    memset(f, 0, sizeof(*f));
    if (put_byte(s, &s->msgs, '[')) return -1;
    int done = anthropic_request(s, f, request);
    if (done) return done;
    if (f->last_plain_assistant) return 1; /* a prefill: the reply continues it */
    done = request_tools(s, request, 1);
    if (done) return done;
    done = is_string(&s->nodes[content]) ? text_message(s, f, &s->nodes[content], "assistant")
                                          : anthropic_turn(s, f, content, 1);
    if (done) return done;
    if (put_byte(s, &s->msgs, ']')) return -1;
    call->model = call_model(s, response, request);
    if (call->model == -2) return 1;
    call->created = -1;
    call->provider = "anthropic";
    return 0;
}

/* -- Gemini generateContent ------------------------------------------------------------------ */
/* gemini.get: obj[camel] if present, else obj[snake]. */
static Py_ssize_t gget(State *s, Py_ssize_t obj, const char *camel, const char *snake) {
    Py_ssize_t v = member(s, obj, camel);
    return v >= 0 ? v : member(s, obj, snake);
}

/* gemini._turn of a text-only turn (text and thought parts; a part that is only a thought
 * signature is skipped), then finish. 0, 1 or -1. */
static int gemini_turn(State *s, Finish *f, Py_ssize_t content, const char *default_role) {
    if (s->nodes[content].type != N_OBJ) return 1;
    Py_ssize_t role = member(s, content, "role");
    const char *canon;
    int t = role >= 0 ? truth(s, role) : 0;
    if (t < 0) return 1;
    const Node *r = t ? &s->nodes[role] : NULL;
    if (r ? str_is(s, r, "model") : strcmp(default_role, "model") == 0) canon = "assistant";
    else if (r ? (str_is(s, r, "user") || str_is(s, r, "function") || str_is(s, r, "tool"))
               : 1) canon = "user";
    else return 1;
    Py_ssize_t parts_node = gget(s, content, "parts", "parts");
    if (parts_node < 0 || s->nodes[parts_node].type != N_ARR) return 1;
    int parts = 0;
    if (begin_message(s, f)) return -1;
    Py_ssize_t part = parts_node + 1;
    for (Py_ssize_t k = 0; k < s->nodes[parts_node].len; k++, part = s->nodes[part].next) {
        if (s->nodes[part].type != N_OBJ) return 1;
        Py_ssize_t text = member(s, part, "text");
        if (text >= 0) {
            if (!is_string(&s->nodes[text])) return 1;
            Py_ssize_t thought = member(s, part, "thought");
            int reasoning = thought >= 0 && s->nodes[thought].type == N_RAW &&
                            s->base[s->nodes[thought].start] == 't';
            if (text_part(s, &s->nodes[text], reasoning ? "reasoning" : "text", &parts))
                return -1;
            continue;
        }
        Py_ssize_t sig = gget(s, part, "thoughtSignature", "thought_signature");
        if (s->nodes[part].len == 1 && !is_null(s, sig)) continue;
        return 1; /* images, function calls and responses, anything else */
    }
    if (end_message(s, canon)) return -1;
    if (canon[0] == 'a') f->num_assistant++;
    f->last_plain_assistant = canon[0] == 'a';
    return put_byte(s, &s->msgs, '}') ? -1 : 0;
}

/* gemini.convert_request: the system instruction, then the contents. 0, 1 or -1. */
static int gemini_request(State *s, Finish *f, Py_ssize_t request) {
    if (member(s, request, "config") >= 0) return 1; /* (the SDK's config: not read here) */
    Py_ssize_t system = gget(s, request, "systemInstruction", "system_instruction");
    if (!is_null(s, system)) {
        int parts = 0;
        if (begin_message(s, f)) return -1;
        if (is_string(&s->nodes[system])) {
            if (text_part(s, &s->nodes[system], "text", &parts)) return -1;
        } else {
            if (s->nodes[system].type != N_OBJ) return 1;
            Py_ssize_t list = member(s, system, "parts");
            if (list < 0 || s->nodes[list].type != N_ARR) return 1;
            Py_ssize_t part = list + 1;
            for (Py_ssize_t k = 0; k < s->nodes[list].len; k++, part = s->nodes[part].next) {
                if (s->nodes[part].type != N_OBJ) return 1;
                Py_ssize_t text = member(s, part, "text");
                if (text < 0 || !is_string(&s->nodes[text])) return 1;
                if (text_part(s, &s->nodes[text], "text", &parts)) return -1;
            }
        }
        if (end_message(s, "system") || put_byte(s, &s->msgs, '}')) return -1;
        f->last_plain_assistant = 0;
    }
    Py_ssize_t contents = gget(s, request, "contents", "contents");
    if (contents < 0 || s->nodes[contents].type != N_ARR) return 1; /* (text: one user turn) */
    Py_ssize_t content = contents + 1;
    for (Py_ssize_t i = 0; i < s->nodes[contents].len; i++, content = s->nodes[content].next) {
        int done = gemini_turn(s, f, content, "user");
        if (done) return done;
    }
    return 0;
}

/* gemini.convert_tools: the function declarations of every tool. 0, 1 or -1. */
static int gemini_tools(State *s, Py_ssize_t request) {
    Buf *b = &s->tools;
    Py_ssize_t tools = gget(s, request, "tools", "tools");
    if (put_byte(s, b, '[')) return -1;
    if (!is_null(s, tools)) {
        if (s->nodes[tools].type != N_ARR) return 1;
        Py_ssize_t tool = tools + 1, n = 0;
        for (Py_ssize_t i = 0; i < s->nodes[tools].len; i++, tool = s->nodes[tool].next) {
            if (s->nodes[tool].type != N_OBJ) return 1;
            Py_ssize_t decls = gget(s, tool, "functionDeclarations", "function_declarations");
            if (is_null(s, decls)) continue; /* a switch (googleSearch...), not a function */
            if (s->nodes[decls].type != N_ARR) return 1;
            Py_ssize_t decl = decls + 1;
            for (Py_ssize_t k = 0; k < s->nodes[decls].len; k++, decl = s->nodes[decl].next) {
                if (s->nodes[decl].type != N_OBJ) return 1;
                Py_ssize_t params = gget(s, decl, "parameters", "parameters");
                if (is_null(s, params))
                    params = gget(s, decl, "parametersJsonSchema", "parameters_json_schema");
                int done = write_tool(s, n++, member(s, decl, "name"),
                                      member(s, decl, "description"), params);
                if (done) return done;
            }
        }
    }
    return put_byte(s, b, ']');
}

/* A logged Gemini call (gemini.normalize_call, then finish) with one text candidate. */
static int gemini_call(State *s, Call *call) {
    Py_ssize_t request = member(s, 0, "request"), response = member(s, 0, "response");
    if (request < 0 || response < 0 || s->nodes[request].type != N_OBJ ||
        s->nodes[response].type != N_OBJ || !completed(s))
        return 1;
    Py_ssize_t candidates = gget(s, response, "candidates", "candidates");
    if (candidates < 0 || s->nodes[candidates].type != N_ARR || s->nodes[candidates].len != 1)
        return 1;
    Py_ssize_t cand = candidates + 1;
    if (s->nodes[cand].type != N_OBJ) return 1;
    Py_ssize_t content = gget(s, cand, "content", "content");
    if (content < 0 || s->nodes[content].type != N_OBJ) return 1;
    Py_ssize_t cparts = gget(s, content, "parts", "parts");
    if (cparts < 0 || s->nodes[cparts].type != N_ARR || !s->nodes[cparts].len) return 1;
    Finish *f = &call->f;
    memset(f, 0, sizeof(*f));
    if (put_byte(s, &s->msgs, '[')) return -1;
    int done = gemini_request(s, f, request);
    if (done) return done;
    if (f->last_plain_assistant) return 1; /* the reply would continue it */
    done = gemini_tools(s, request);
    if (done) return done;
    int before = f->num_assistant;
    done = gemini_turn(s, f, content, "model");
    if (done) return done;
    if (f->num_assistant != before + 1) return 1; /* not the model's turn: rejected */
    if (put_byte(s, &s->msgs, ']')) return -1;
    /* the model: modelVersion, else the request's, else the one in the endpoint's path */
    Py_ssize_t model = gget(s, response, "modelVersion", "model_version");
    int t = model >= 0 ? truth(s, model) : 0;
    if (t < 0) return 1;
    if (!t) model = member(s, request, "model");
    t = model >= 0 ? truth(s, model) : 0;
    if (t < 0) return 1;
    call->model = model >= 0 && is_string(&s->nodes[model]) ? model : -1;
    Py_ssize_t endpoint = member(s, 0, "endpoint");
    if (!t && endpoint >= 0 && is_string(&s->nodes[endpoint])) {
        const unsigned char *e = str_bytes(s, &s->nodes[endpoint]);
        Py_ssize_t n = s->nodes[endpoint].len;
        for (Py_ssize_t i = 0; i + 7 < n; i++) { /* models/([^/:?]+) */
            if (memcmp(e + i, "models/", 7) != 0) continue;
            Py_ssize_t j = i + 7;
            while (j < n && e[j] != '/' && e[j] != ':' && e[j] != '?') j++;
            if (j > i + 7) {
                call->model = -1;
                call->model_text = e + i + 7;
                call->model_len = j - i - 7;
                break;
            }
        }
    }
    if (call->model >= 0) {
        call->model_text = str_bytes(s, &s->nodes[call->model]);
        call->model_len = s->nodes[call->model].len;
        call->model = -1;
    }
    if (call->model_text && call->model_len >= 7 && memcmp(call->model_text, "models/", 7) == 0) {
        call->model_text += 7; /* _model_name */
        call->model_len -= 7;
    }
    call->created = -1;
    call->provider = "gemini";
    return 0;
}

/* An OpenAI fine-tuning line ({"messages", "tools"?, "model"?}: openai.normalize). */
static int openai_line(State *s, Call *call) {
    Finish *f = &call->f;
    int done = openai_messages(s, f, 0);
    if (done) return done;
    if (!f->num_assistant) return 1; /* rejected: nothing to learn from */
    done = request_tools(s, 0, 0);
    if (done) return done;
    if (put_byte(s, &s->msgs, ']')) return -1;
    Py_ssize_t model = member(s, 0, "model");
    call->model = model >= 0 && is_string(&s->nodes[model]) ? model : -1;
    call->created = -1;
    call->provider = "openai";
    return 0;
}

/* The record's format as detect_format would find it, for the shapes read here, then the
 * record itself. 0, 1 (not one of them, or not sure) or -1. */
static int normalize_c(State *s, Call *call) {
    if (s->nodes[0].type != N_OBJ) return 1;
    if (member(s, 0, "otlp_trace") >= 0 || member(s, 0, "resourceSpans") >= 0 ||
        member(s, 0, "resource_spans") >= 0)
        return 1;
    Py_ssize_t request = member(s, 0, "request"), response = member(s, 0, "response");
    if (request >= 0 && (response >= 0 || member(s, 0, "stream") >= 0)) {
        if (response < 0 || s->nodes[response].type != N_OBJ) return 1;
        Py_ssize_t provider = member(s, 0, "provider");
        if (!is_null(s, provider)) {
            if (str_is(s, &s->nodes[provider], "openai")) return openai_call(s, call);
            if (str_is(s, &s->nodes[provider], "anthropic")) return anthropic_call(s, call);
            if (str_is(s, &s->nodes[provider], "gemini")) return gemini_call(s, call);
            return 1;
        }
        /* _call_format: by the response */
        if (member(s, response, "candidates") >= 0 || member(s, response, "promptFeedback") >= 0)
            return gemini_call(s, call);
        Py_ssize_t type = member(s, response, "type");
        if (type >= 0) {
            if (str_is(s, &s->nodes[type], "message")) return anthropic_call(s, call);
            return 1;
        }
        return member(s, response, "choices") >= 0 ? openai_call(s, call) : 1;
    }
    if (member(s, 0, "conversations") >= 0 || member(s, 0, "contents") >= 0) return 1;
    if (member(s, 0, "messages") < 0) return 1;
    /* _looks_anthropic: a system prompt, input_schema tools (messages with block content
     * are not read here, and a string content says nothing) */
    if (member(s, 0, "system") >= 0) return 1;
    Py_ssize_t tools = member(s, 0, "tools");
    if (tools >= 0 && s->nodes[tools].type == N_ARR) {
        Py_ssize_t tool = tools + 1;
        for (Py_ssize_t i = 0; i < s->nodes[tools].len; i++, tool = s->nodes[tool].next)
            if (s->nodes[tool].type == N_OBJ && member(s, tool, "input_schema") >= 0) return 1;
    }
    return openai_line(s, call);
}

/* -- Anthropic Messages ---------------------------------------------------------------------- */
/* anthropic._turn of a turn with block content, then finish: its tool results as tool
 * messages, then the rest as one message (text and thinking parts, tool calls). 0, 1 or -1. */
static int anthropic_turn(State *s, Finish *f, Py_ssize_t content, int is_assistant) {
    if (s->nodes[content].type != N_ARR) return 1;
    Py_ssize_t count = s->nodes[content].len, block = content + 1;
    int n_parts = 0, n_calls = 0, n_tools = 0;
    /* the tool results first (they are their own messages), checking every block */
    for (Py_ssize_t k = 0; k < count; k++, block = s->nodes[block].next) {
        if (s->nodes[block].type != N_OBJ) return 1;
        Py_ssize_t type = member(s, block, "type");
        if (type < 0) return 1;
        const Node *t = &s->nodes[type];
        if (str_is(s, t, "text") || str_is(s, t, "thinking")) {
            int thinking = t->len == 8;
            if (thinking && !is_assistant) return 1;
            Py_ssize_t text = member(s, block, thinking ? "thinking" : "text");
            if (text < 0 || !is_string(&s->nodes[text])) return 1;
            n_parts++;
        } else if (str_is(s, t, "tool_use")) {
            if (!is_assistant) return 1;
            Py_ssize_t input = member(s, block, "input"), name = member(s, block, "name");
            Py_ssize_t id = member(s, block, "id");
            if (input >= 0 && s->nodes[input].type != N_OBJ) return 1;
            if (name < 0 || !is_string(&s->nodes[name]) || !s->nodes[name].len) return 1;
            if (!is_null(s, id) && !is_string(&s->nodes[id])) return 1;
            n_calls++;
        } else if (str_is(s, t, "tool_result")) {
            if (is_assistant) return 1;
            Py_ssize_t use_id = member(s, block, "tool_use_id");
            Py_ssize_t result = member(s, block, "content");
            if (use_id < 0 || !is_string(&s->nodes[use_id]) || !s->nodes[use_id].len) return 1;
            int parts = 0;
            if (begin_message(s, f)) return -1;
            if (!is_null(s, result)) {
                if (is_string(&s->nodes[result])) {
                    if (json_text(s, &s->nodes[result])) return 1;
                    if (tmp_part(s, &parts)) return -1;
                } else if (s->nodes[result].type == N_ARR) {
                    Py_ssize_t rb = result + 1;
                    for (Py_ssize_t j = 0; j < s->nodes[result].len; j++, rb = s->nodes[rb].next) {
                        if (s->nodes[rb].type != N_OBJ) return 1;
                        Py_ssize_t rt = member(s, rb, "type"), rtext = member(s, rb, "text");
                        if (rt < 0 || !str_is(s, &s->nodes[rt], "text")) return 1; /* images */
                        if (rtext < 0 || !is_string(&s->nodes[rtext])) return 1;
                        if (json_text(s, &s->nodes[rtext])) return 1;
                        if (tmp_part(s, &parts)) return -1;
                    }
                } else {
                    return 1;
                }
            }
            const Node *pid = &s->nodes[use_id];
            int cid = answer(f, str_bytes(s, pid), pid->len, NULL, 0);
            if (cid < 0) return 1;
            if (end_message(s, "tool") || put(s, &s->msgs, ",\"tool_call_id\":", 16) ||
                put_call_id(s, &s->msgs, cid) || put_byte(s, &s->msgs, '}'))
                return -1;
            n_tools++;
        } else if (!str_is(s, t, "redacted_thinking")) {
            return 1; /* images, documents, unknown blocks */
        }
    }
    if (!(n_parts || n_calls || !n_tools)) return 0;
    /* the turn's own message */
    int parts = 0;
    if (begin_message(s, f)) return -1;
    block = content + 1;
    for (Py_ssize_t k = 0; k < count; k++, block = s->nodes[block].next) {
        const Node *t = &s->nodes[member(s, block, "type")];
        if (str_is(s, t, "text")) {
            if (text_part(s, &s->nodes[member(s, block, "text")], "text", &parts)) return -1;
        } else if (str_is(s, t, "thinking")) {
            if (text_part(s, &s->nodes[member(s, block, "thinking")], "reasoning", &parts))
                return -1;
        }
    }
    if (end_message(s, is_assistant ? "assistant" : "user")) return -1;
    if (is_assistant) f->num_assistant++;
    if (n_calls) {
        if (put(s, &s->msgs, ",\"tool_calls\":[", 15)) return -1;
        Py_ssize_t j = 0;
        block = content + 1;
        for (Py_ssize_t k = 0; k < count; k++, block = s->nodes[block].next) {
            if (!str_is(s, &s->nodes[member(s, block, "type")], "tool_use")) continue;
            Py_ssize_t input = member(s, block, "input"), id = member(s, block, "id");
            s->tmp.len = 0;
            if (input < 0) {
                if (put(s, &s->tmp, "{}", 2)) return -1;
            } else if (write_value(s, &s->tmp, input, F_NOFLOAT)) {
                return s->error == 2 ? -1 : 1;
            }
            int done = emit_call(s, f, j++, is_null(s, id) ? -1 : id, member(s, block, "name"));
            if (done) return done;
        }
        if (put_byte(s, &s->msgs, ']')) return -1;
        f->has_tool_calls = 1;
    }
    f->last_plain_assistant = is_assistant && !n_calls;
    return put_byte(s, &s->msgs, '}') ? -1 : 0;
}

/* A plain-text message of ``role`` (its content a string). */
static int text_message(State *s, Finish *f, const Node *text, const char *role) {
    int parts = 0;
    if (begin_message(s, f) || text_part(s, text, "text", &parts) || end_message(s, role) ||
        put_byte(s, &s->msgs, '}'))
        return -1;
    if (strcmp(role, "assistant") == 0) f->num_assistant++;
    f->last_plain_assistant = strcmp(role, "assistant") == 0;
    return 0;
}

/* anthropic.convert_request: the system prompt, then every message. 0, 1 or -1. */
static int anthropic_request(State *s, Finish *f, Py_ssize_t request) {
    Py_ssize_t system = member(s, request, "system");
    if (!is_null(s, system)) {
        const Node *sys = &s->nodes[system];
        int parts = 0;
        if (is_string(sys)) {
            if (begin_message(s, f) || text_part(s, sys, "text", &parts)) return -1;
        } else if (sys->type == N_ARR) {
            if (begin_message(s, f)) return -1;
            Py_ssize_t block = system + 1;
            for (Py_ssize_t k = 0; k < sys->len; k++, block = s->nodes[block].next) {
                if (s->nodes[block].type != N_OBJ) return 1;
                Py_ssize_t type = member(s, block, "type"), text = member(s, block, "text");
                if (type < 0 || !str_is(s, &s->nodes[type], "text")) return 1;
                if (text < 0 || !is_string(&s->nodes[text])) return 1;
                if (text_part(s, &s->nodes[text], "text", &parts)) return -1;
            }
        } else {
            return 1;
        }
        if (end_message(s, "system") || put_byte(s, &s->msgs, '}')) return -1;
        f->last_plain_assistant = 0;
    }
    Py_ssize_t messages = member(s, request, "messages");
    if (messages < 0 || s->nodes[messages].type != N_ARR) return 1;
    Py_ssize_t msg = messages + 1;
    for (Py_ssize_t i = 0; i < s->nodes[messages].len; i++, msg = s->nodes[msg].next) {
        if (s->nodes[msg].type != N_OBJ) return 1;
        Py_ssize_t role = member(s, msg, "role"), content = member(s, msg, "content");
        if (role < 0) return 1;
        int is_assistant = str_is(s, &s->nodes[role], "assistant");
        if (!is_assistant && !str_is(s, &s->nodes[role], "user")) return 1;
        if (content < 0) return 1;
        int done = is_string(&s->nodes[content])
            ? text_message(s, f, &s->nodes[content], is_assistant ? "assistant" : "user")
            : anthropic_turn(s, f, content, is_assistant);
        if (done) return done;
    }
    return 0;
}

static PyObject *node_text(State *s, Py_ssize_t node) {
    if (node < 0) Py_RETURN_NONE;
    const Node *n = &s->nodes[node];
    if (is_string(n)) return PyUnicode_DecodeUTF8((const char *)str_bytes(s, n), n->len, NULL);
    return PyBytes_FromStringAndSize((const char *)s->base + n->src, n->src_end - n->src);
}

/* The buffers of the last call, kept for the next one: a streamed record's ~100 KB of nodes
 * malloc'ed afresh each call would be mapped and faulted in again every time. A call made while
 * they are in use (from another thread, while this one runs Python code: the GC when a
 * result is built) gets buffers of its own. */
static State cache;
static int cache_busy;

#define CACHE_MAX_BYTES (8 << 20) /* larger buffers are freed after the call */

static void acquire(State *s) {
    memset(s, 0, sizeof(*s));
    if (cache_busy) return;
    cache_busy = 1;
    s->nodes = cache.nodes;
    s->cap_nodes = cache.cap_nodes;
    s->arena = cache.arena;
    s->out = cache.out;
    s->collapsed = cache.collapsed;
    s->run = cache.run;
    s->msgs = cache.msgs;
    s->tools = cache.tools;
    s->tmp = cache.tmp;
    s->members = cache.members;
    s->cap_members = cache.cap_members;
    s->arena.len = s->out.len = s->collapsed.len = s->run.len = 0;
    s->msgs.len = s->tools.len = s->tmp.len = 0;
    s->cache = 1;
}

static void release(State *s) {
    if (s->cache && (Py_ssize_t)(s->cap_nodes * sizeof(Node)) + s->arena.cap + s->out.cap +
                            s->collapsed.cap + s->run.cap + s->msgs.cap + s->tools.cap +
                            s->tmp.cap <= CACHE_MAX_BYTES) {
        cache.nodes = s->nodes;
        cache.cap_nodes = s->cap_nodes;
        cache.arena = s->arena;
        cache.out = s->out;
        cache.collapsed = s->collapsed;
        cache.run = s->run;
        cache.msgs = s->msgs;
        cache.tools = s->tools;
        cache.tmp = s->tmp;
        cache.members = s->members;
        cache.cap_members = s->cap_members;
        cache_busy = 0;
        return;
    }
    PyMem_Free(s->nodes);
    PyMem_Free(s->arena.data);
    PyMem_Free(s->out.data);
    PyMem_Free(s->collapsed.data);
    PyMem_Free(s->run.data);
    PyMem_Free(s->msgs.data);
    PyMem_Free(s->tools.data);
    PyMem_Free(s->tmp.data);
    PyMem_Free(s->members);
    if (s->cache) {
        memset(&cache, 0, sizeof(cache));
        cache_busy = 0;
    }
}

/* Parse the whole text and write its canonical bytes into s->out: 0, or -1 (s->error). */
static int canonical(State *s, Py_buffer *view) {
    if (view->len >= INT32_MAX / 2) return fail(s); /* (offsets are 32-bit, and the arena's
                                                       decoded strings are within the line) */
    s->base = s->p = (const unsigned char *)view->buf;
    s->end = s->p + view->len;
    if (grow((void **)&s->nodes, &s->cap_nodes, view->len / 16 + 16, sizeof(Node), s) ||
        grow((void **)&s->out.data, &s->out.cap, view->len + 16, 1, s))
        return -1;
    if (parse_value(s, 0) < 0) return -1;
    skip_ws(s);
    if (s->p != s->end) return fail(s);
    return write_value(s, &s->out, 0, 0);
}

static PyObject *canonical_bytes(PyObject *module, PyObject *arg) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    State s;
    acquire(&s);
    PyObject *result;
    if (canonical(&s, &view) == 0) result = PyBytes_FromStringAndSize((char *)s.out.data, s.out.len);
    else result = s.error == 2 ? NULL : Py_NewRef(Py_None);
    release(&s);
    PyBuffer_Release(&view);
    return result;
}

/* What the Python side needs of a line (see rows.fast_outcome): None, ("stream", canonical,
 * collapsed) or, with ``rules``, ("call", canonical, messages JSON, tools JSON, model, created,
 * turns, has_tool_calls). */
static PyObject *read_line(PyObject *arg, int rules) {
    Py_buffer view;
    if (PyObject_GetBuffer(arg, &view, PyBUF_SIMPLE) < 0) return NULL;
    State s;
    acquire(&s);
    PyObject *result = NULL;
    int done = canonical(&s, &view);
    if (done == 0) {
        done = collapse(&s);
        if (done == 0) {
            result = Py_BuildValue("(sy#y#)", "stream", (char *)s.out.data, s.out.len,
                                   (char *)s.collapsed.data, s.collapsed.len);
        } else if (done == 1 && !rules) {
            result = Py_NewRef(Py_None);
        } else if (done == 1) {
            Call call;
            memset(&call, 0, sizeof(call));
            call.model = call.created = -1;
            s.error = 0;
            done = normalize_c(&s, &call);
            if (done == 0) {
                PyObject *model = call.model_text
                    ? PyUnicode_DecodeUTF8((const char *)call.model_text, call.model_len, NULL)
                    : node_text(&s, call.model);
                PyObject *created = call.created >= 0 ? node_text(&s, call.created)
                                                      : Py_NewRef(Py_None);
                if (model && created)
                    result = Py_BuildValue("(sy#y#y#OOiis)", "call", (char *)s.out.data,
                                           s.out.len, (char *)s.msgs.data, s.msgs.len,
                                           (char *)s.tools.data, s.tools.len, model, created,
                                           call.f.num_assistant, call.f.has_tool_calls,
                                           call.provider);
                Py_XDECREF(model);
                Py_XDECREF(created);
            } else if (done == 1 && s.error != 2) {
                result = Py_NewRef(Py_None);
            }
        }
    } else if (s.error != 2) {
        result = Py_NewRef(Py_None);
    }
    release(&s);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *fast_record(PyObject *module, PyObject *arg) {
    (void)module;
    return read_line(arg, 1);
}

static PyObject *merge_stream(PyObject *module, PyObject *arg) {
    (void)module;
    return read_line(arg, 0);
}

static PyMethodDef methods[] = {
    {"canonical_bytes", canonical_bytes, METH_O,
     "canonical_bytes(line, /)\n--\n\n"
     "orjson.dumps(orjson.loads(line), option=OPT_SORT_KEYS), or None where not sure."},
    {"fast_record", fast_record, METH_O,
     "fast_record(line, /)\n--\n\nA streamed or logged call read in C, or None."},
    {"merge_stream", merge_stream, METH_O,
     "merge_stream(line, /)\n--\n\nA streamed OpenAI call with its text-only chunks merged, "
     "or None."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "_fastpath",
    "The common records of a file ingest read in C (see fast_record).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    PyObject *orjson = PyImport_ImportModule("orjson");
    if (!orjson) return NULL;
    orjson_loads = PyObject_GetAttrString(orjson, "loads");
    orjson_dumps = PyObject_GetAttrString(orjson, "dumps");
    Py_DECREF(orjson);
    if (!orjson_loads || !orjson_dumps) return NULL;
    return PyModule_Create(&moduledef);
}
