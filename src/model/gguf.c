/*
 * gguf.c: the GGUF file reader. A model file is memory-mapped and its header
 * (metadata and tensor descriptions) parsed once, at open, with every length,
 * count and offset checked against the bytes that remain, in arithmetic that
 * cannot overflow. After a successful open the rest of cascade reads the
 * header through plain lookups and the tensor data straight from the mapping,
 * with no bounds left to get wrong. Input files are untrusted (they come
 * from the internet): a bad file must end in a status and a message, never
 * a crash, and fuzz/fuzz_gguf.c keeps that promise honest.
 *
 * Layout (versions 2 and 3; v3 only adds big-endian files, which we refuse):
 *   u32 magic "GGUF", u32 version, u64 n_tensors, u64 n_kv,
 *   n_kv x { string key, u32 type, value },
 *   n_tensors x { string name, u32 n_dims, u64 ne[n_dims], u32 type, u64 offset },
 *   padding to general.alignment (default 32), tensor data.
 * A string is a u64 byte length and the bytes (no NUL). An array value is a
 * u32 element type, a u64 count and the elements.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "model.h"

#define GGUF_MAGIC 0x46554747u /* "GGUF" read as a little-endian u32 */
#define GGUF_DEFAULT_ALIGNMENT 32u
#define GGUF_MAX_DIMS 4u

typedef struct {
    const char *key;    /* NUL-terminated copy in the arena */
    uint64_t key_len;
    uint32_t type;      /* cas_gguf_type */
    uint64_t val_off;   /* file offset of the value (scalars) */
    const char *str;    /* strings: NUL-terminated copy in the arena */
    uint64_t str_len;
    cas_gguf_arr arr;   /* arrays */
} kv_entry;

struct cas_gguf {
    const uint8_t *base; /* the file's bytes */
    size_t size;
    int mapped;          /* 1: base is our mmap (of the file, or anonymous memory the file was
                            read into) of map_bytes; 0: borrowed memory */
    size_t map_bytes;
    uint32_t version;
    uint32_t alignment;
    uint64_t data_off;
    int64_t n_kv;
    kv_entry *kv;        /* [n_kv] */
    int64_t n_tensors;
    cas_gguf_tensor *tensors; /* [n_tensors] */
    char *arena;         /* NUL-terminated copies of keys, names and string values */
    int64_t *kv_hash;    /* open addressing, [hash_cap], -1 empty */
    int64_t *t_hash;     /* [hash_cap] */
    size_t hash_cap;     /* power of two */
};

/* ---- bounded reading --------------------------------------------------- */

typedef struct {
    const uint8_t *p;
    size_t size;
    size_t pos;
} reader;

static cas_status need(const reader *r, uint64_t n, const char *what) {
    if (n > (uint64_t)(r->size - r->pos))
        return cas_error(CAS_ERR_FORMAT,
                         "gguf: truncated: %s at offset %zu needs %" PRIu64
                         " bytes, %zu remain",
                         what, r->pos, n, r->size - r->pos);
    return CAS_OK;
}

static cas_status rd_u32(reader *r, uint32_t *v, const char *what) {
    cas_status st = need(r, 4, what);
    if (st) return st;
    memcpy(v, r->p + r->pos, 4);
    r->pos += 4;
    return CAS_OK;
}

static cas_status rd_u64(reader *r, uint64_t *v, const char *what) {
    cas_status st = need(r, 8, what);
    if (st) return st;
    memcpy(v, r->p + r->pos, 8);
    r->pos += 8;
    return CAS_OK;
}

/* A string: leaves a view of its bytes in *s. */
static cas_status rd_str(reader *r, cas_gguf_str *s, const char *what) {
    uint64_t len;
    cas_status st = rd_u64(r, &len, what);
    if (st) return st;
    if ((st = need(r, len, what))) return st;
    s->ptr = (const char *)r->p + r->pos;
    s->len = len;
    r->pos += (size_t)len;
    return CAS_OK;
}

/* Bytes of one scalar of a value type; 0 for string, array and bad ids. */
static size_t scalar_size(uint32_t t) {
    switch (t) {
    case CAS_GGUF_U8: case CAS_GGUF_I8: case CAS_GGUF_BOOL: return 1;
    case CAS_GGUF_U16: case CAS_GGUF_I16: return 2;
    case CAS_GGUF_U32: case CAS_GGUF_I32: case CAS_GGUF_F32: return 4;
    case CAS_GGUF_U64: case CAS_GGUF_I64: case CAS_GGUF_F64: return 8;
    default: return 0;
    }
}

const char *cas_gguf_type_name(int t) {
    static const char *const names[] = {"u8",  "i8",   "u16",    "i16",   "u32", "i32", "f32",
                                        "bool", "string", "array", "u64", "i64", "f64"};
    if (t < 0 || t > CAS_GGUF_F64) return "?";
    return names[t];
}

/* ---- hashing ----------------------------------------------------------- */

static uint64_t hash_bytes(const char *s, size_t n) {
    uint64_t h = 0xcbf29ce484222325ull; /* FNV-1a */
    for (size_t i = 0; i < n; i++) {
        h ^= (unsigned char)s[i];
        h *= 0x100000001b3ull;
    }
    return h ^ (h >> 29);
}

/* Inserts index idx whose name is name into table; returns the index already
 * holding an equal name, or -1 when inserted. */
static int64_t hash_insert(int64_t *table, size_t cap, const char *name, int64_t idx,
                           const char *(*name_of)(const cas_gguf *, int64_t), const cas_gguf *g) {
    size_t mask = cap - 1, h = (size_t)hash_bytes(name, strlen(name)) & mask;
    while (table[h] >= 0) {
        if (!strcmp(name_of(g, table[h]), name)) return table[h];
        h = (h + 1) & mask;
    }
    table[h] = idx;
    return -1;
}

static int64_t hash_find(const int64_t *table, size_t cap, const char *name,
                         const char *(*name_of)(const cas_gguf *, int64_t), const cas_gguf *g) {
    if (!cap) return -1;
    size_t mask = cap - 1, h = (size_t)hash_bytes(name, strlen(name)) & mask;
    while (table[h] >= 0) {
        if (!strcmp(name_of(g, table[h]), name)) return table[h];
        h = (h + 1) & mask;
    }
    return -1;
}

static const char *kv_name(const cas_gguf *g, int64_t i) { return g->kv[i].key; }
static const char *tensor_name(const cas_gguf *g, int64_t i) { return g->tensors[i].name; }

/* ---- parsing ----------------------------------------------------------- */

/* Parses one value of type `type` at the reader (the type id is already
 * read). Arrays fill e->arr; strings fill e->str/str_len (a view for now). */
static cas_status parse_value(cas_gguf *g, reader *r, uint32_t type, kv_entry *e) {
    cas_status st;
    e->val_off = r->pos;
    if (type == CAS_GGUF_STRING) {
        cas_gguf_str s;
        if ((st = rd_str(r, &s, "string value"))) return st;
        e->str = s.ptr;
        e->str_len = s.len;
        return CAS_OK;
    }
    if (type == CAS_GGUF_ARRAY) {
        uint32_t et;
        uint64_t n;
        size_t at = r->pos;
        if ((st = rd_u32(r, &et, "array element type"))) return st;
        if ((st = rd_u64(r, &n, "array length"))) return st;
        e->arr.type = (cas_gguf_type)et;
        e->arr.n = n;
        e->arr.base_ = g->base;
        e->arr.data = r->p + r->pos;
        if (et == CAS_GGUF_ARRAY)
            return cas_error(CAS_ERR_UNSUPPORTED, "gguf: nested array at offset %zu", at);
        if (et == CAS_GGUF_STRING) {
            /* each element is at least its 8-byte length prefix */
            if (n > (uint64_t)(r->size - r->pos) / 8)
                return cas_error(CAS_ERR_FORMAT,
                                 "gguf: array of %" PRIu64 " strings at offset %zu runs past the end",
                                 n, at);
            uint64_t *offs = cas_alloc_array(n ? (size_t)n : 1, sizeof *offs);
            if (!offs) return cas_error(CAS_ERR_NOMEM, "gguf: no memory for a %" PRIu64 "-string array", n);
            e->arr.offs_ = offs;
            for (uint64_t i = 0; i < n; i++) {
                cas_gguf_str s;
                offs[i] = r->pos;
                if ((st = rd_str(r, &s, "array string"))) return st;
            }
            return CAS_OK;
        }
        size_t es = scalar_size(et);
        if (!es)
            return cas_error(CAS_ERR_FORMAT, "gguf: bad array element type %" PRIu32 " at offset %zu",
                             et, at);
        if (n > (uint64_t)(r->size - r->pos) / es)
            return cas_error(CAS_ERR_FORMAT,
                             "gguf: array of %" PRIu64 " %s at offset %zu runs past the end", n,
                             cas_gguf_type_name((int)et), at);
        r->pos += (size_t)(n * es);
        return CAS_OK;
    }
    size_t es = scalar_size(type);
    if (!es) return cas_error(CAS_ERR_FORMAT, "gguf: bad value type %" PRIu32 " at offset %zu", type, r->pos - 4);
    if ((st = need(r, es, "scalar value"))) return st;
    r->pos += es;
    return CAS_OK;
}

static int has_nul(const char *s, uint64_t n) { return memchr(s, 0, (size_t)n) != NULL; }

static cas_status parse(cas_gguf *g) {
    reader r = {g->base, g->size, 0};
    cas_status st;
    uint32_t magic, version;
    uint64_t n_tensors, n_kv;
    /* views of keys and names until the arena exists */
    cas_gguf_str *keys = NULL, *names = NULL;

    {
        uint32_t one = 1;
        unsigned char c;
        memcpy(&c, &one, 1);
        if (c != 1) return cas_error(CAS_ERR_UNSUPPORTED, "gguf: big-endian hosts are not supported");
    }
    if ((st = rd_u32(&r, &magic, "magic"))) return st;
    if (magic != GGUF_MAGIC)
        return cas_error(CAS_ERR_FORMAT, "gguf: not a GGUF file (magic 0x%08" PRIx32 ")", magic);
    if ((st = rd_u32(&r, &version, "version"))) return st;
    if (version == 0x02000000u || version == 0x03000000u)
        return cas_error(CAS_ERR_UNSUPPORTED, "gguf: big-endian GGUF files are not supported");
    if (version != 2 && version != 3)
        return cas_error(CAS_ERR_UNSUPPORTED, "gguf: version %" PRIu32 " not supported (only 2 and 3)",
                         version);
    g->version = version;
    if ((st = rd_u64(&r, &n_tensors, "tensor count"))) return st;
    if ((st = rd_u64(&r, &n_kv, "metadata count"))) return st;
    /* a key/value pair takes at least 13 bytes, a tensor description 24 */
    if (n_kv > (uint64_t)(g->size - r.pos) / 13)
        return cas_error(CAS_ERR_FORMAT, "gguf: metadata count %" PRIu64 " is absurd for a %zu-byte file",
                         n_kv, g->size);
    if (n_tensors > (uint64_t)(g->size - r.pos) / 24)
        return cas_error(CAS_ERR_FORMAT, "gguf: tensor count %" PRIu64 " is absurd for a %zu-byte file",
                         n_tensors, g->size);

    g->kv = cas_alloc_array(n_kv ? (size_t)n_kv : 1, sizeof *g->kv);
    g->tensors = cas_alloc_array(n_tensors ? (size_t)n_tensors : 1, sizeof *g->tensors);
    keys = cas_alloc_array(n_kv ? (size_t)n_kv : 1, sizeof *keys);
    names = cas_alloc_array(n_tensors ? (size_t)n_tensors : 1, sizeof *names);
    if (!g->kv || !g->tensors || !keys || !names) {
        st = cas_error(CAS_ERR_NOMEM, "gguf: no memory for the header tables");
        goto done;
    }
    memset(g->kv, 0, (n_kv ? (size_t)n_kv : 1) * sizeof *g->kv);
    memset(g->tensors, 0, (n_tensors ? (size_t)n_tensors : 1) * sizeof *g->tensors);

    uint64_t arena_bytes = 0; /* bounded by the file size plus one byte per entry */
    for (uint64_t i = 0; i < n_kv; i++) {
        kv_entry *e = &g->kv[i];
        size_t at = r.pos;
        uint32_t type;
        g->n_kv = (int64_t)i + 1; /* so cleanup frees what this entry allocates */
        if ((st = rd_str(&r, &keys[i], "metadata key"))) goto done;
        if (has_nul(keys[i].ptr, keys[i].len)) {
            st = cas_error(CAS_ERR_FORMAT, "gguf: metadata key at offset %zu holds a NUL byte", at);
            goto done;
        }
        if ((st = rd_u32(&r, &type, "metadata value type"))) goto done;
        e->type = type;
        e->key_len = keys[i].len;
        if ((st = parse_value(g, &r, type, e))) goto done;
        arena_bytes += keys[i].len + 1;
        if (type == CAS_GGUF_STRING) arena_bytes += e->str_len + 1;
    }
    for (uint64_t i = 0; i < n_tensors; i++) {
        cas_gguf_tensor *t = &g->tensors[i];
        size_t at = r.pos;
        uint32_t n_dims, type;
        if ((st = rd_str(&r, &names[i], "tensor name"))) goto done;
        if (has_nul(names[i].ptr, names[i].len)) {
            st = cas_error(CAS_ERR_FORMAT, "gguf: tensor name at offset %zu holds a NUL byte", at);
            goto done;
        }
        if ((st = rd_u32(&r, &n_dims, "tensor dimension count"))) goto done;
        if (n_dims > GGUF_MAX_DIMS) {
            st = cas_error(CAS_ERR_FORMAT, "gguf: tensor at offset %zu has %" PRIu32 " dims (max 4)", at,
                           n_dims);
            goto done;
        }
        t->n_dims = n_dims;
        int64_t n_elem = 1;
        for (int d = 0; d < 4; d++) t->ne[d] = 1;
        for (uint32_t d = 0; d < n_dims; d++) {
            uint64_t ne;
            if ((st = rd_u64(&r, &ne, "tensor dimension"))) goto done;
            if (ne > (uint64_t)INT64_MAX || (ne && n_elem > INT64_MAX / (int64_t)ne)) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: tensor at offset %zu: dimensions overflow", at);
                goto done;
            }
            t->ne[d] = (int64_t)ne;
            n_elem *= (int64_t)ne;
        }
        t->n_elem = n_elem;
        if ((st = rd_u32(&r, &type, "tensor type"))) goto done;
        if (cas_ttype_block_size((int)type) <= 0) {
            const char *tn = type < 64 ? cas_ttype_ggml_name((int)type) : NULL;
            const int nl = names[i].len < 96 ? (int)names[i].len : 96;
            if (tn)
                st = cas_error(CAS_ERR_UNSUPPORTED, "gguf: tensor '%.*s' has type %s (id %" PRIu32 "), which cascade "
                               "does not support", nl, names[i].ptr, tn, type);
            else
                st = cas_error(type < 64 ? CAS_ERR_UNSUPPORTED : CAS_ERR_FORMAT,
                               "gguf: tensor at offset %zu has unknown type id %" PRIu32, at, type);
            goto done;
        }
        t->type = (cas_ttype)type;
        if (t->ne[0] % cas_ttype_block_size((int)type)) {
            st = cas_error(CAS_ERR_FORMAT,
                           "gguf: tensor at offset %zu: row of %" PRId64 " is not a multiple of the %s block (%" PRId64 ")",
                           at, t->ne[0], cas_ttype_name((int)type), cas_ttype_block_size((int)type));
            goto done;
        }
        int64_t nb = cas_ttype_nbytes((int)type, n_elem);
        if (nb < 0 || (uint64_t)nb > (uint64_t)SIZE_MAX) {
            st = cas_error(CAS_ERR_FORMAT, "gguf: tensor at offset %zu: byte size overflows", at);
            goto done;
        }
        t->nbytes = (size_t)nb;
        if ((st = rd_u64(&r, &t->offset, "tensor data offset"))) goto done;
        arena_bytes += names[i].len + 1;
        g->n_tensors = (int64_t)i + 1;
    }
    g->n_tensors = (int64_t)n_tensors;
    g->n_kv = (int64_t)n_kv;

    /* the arena: NUL-terminated copies, so the API can hand out C strings */
    g->arena = cas_alloc(arena_bytes ? (size_t)arena_bytes : 1);
    if (!g->arena) {
        st = cas_error(CAS_ERR_NOMEM, "gguf: no memory for %" PRIu64 " bytes of names", arena_bytes);
        goto done;
    }
    {
        char *w = g->arena;
        for (uint64_t i = 0; i < n_kv; i++) {
            kv_entry *e = &g->kv[i];
            memcpy(w, keys[i].ptr, (size_t)keys[i].len);
            w[keys[i].len] = 0;
            e->key = w;
            w += keys[i].len + 1;
            if (e->type == CAS_GGUF_STRING) {
                memcpy(w, e->str, (size_t)e->str_len);
                w[e->str_len] = 0;
                e->str = w;
                w += e->str_len + 1;
            }
        }
        for (uint64_t i = 0; i < n_tensors; i++) {
            memcpy(w, names[i].ptr, (size_t)names[i].len);
            w[names[i].len] = 0;
            g->tensors[i].name = w;
            w += names[i].len + 1;
        }
    }

    /* name lookup tables; duplicates are a format error */
    {
        uint64_t most = n_kv > n_tensors ? n_kv : n_tensors;
        size_t cap = 16;
        while (cap < 2 * most) cap *= 2;
        g->hash_cap = cap;
        g->kv_hash = cas_alloc_array(cap, sizeof(int64_t));
        g->t_hash = cas_alloc_array(cap, sizeof(int64_t));
        if (!g->kv_hash || !g->t_hash) {
            st = cas_error(CAS_ERR_NOMEM, "gguf: no memory for lookup tables");
            goto done;
        }
        memset(g->kv_hash, 0xff, cap * sizeof(int64_t));
        memset(g->t_hash, 0xff, cap * sizeof(int64_t));
        for (int64_t i = 0; i < g->n_kv; i++)
            if (hash_insert(g->kv_hash, cap, g->kv[i].key, i, kv_name, g) >= 0) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: duplicate metadata key '%s'", g->kv[i].key);
                goto done;
            }
        for (int64_t i = 0; i < g->n_tensors; i++)
            if (hash_insert(g->t_hash, cap, g->tensors[i].name, i, tensor_name, g) >= 0) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: duplicate tensor name '%s'", g->tensors[i].name);
                goto done;
            }
    }

    /* alignment */
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    {
        int64_t ai = cas_gguf_find_kv(g, "general.alignment");
        if (ai >= 0) {
            uint32_t a;
            if (g->kv[ai].type != CAS_GGUF_U32) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: general.alignment is %s, not u32",
                               cas_gguf_type_name((int)g->kv[ai].type));
                goto done;
            }
            memcpy(&a, g->base + g->kv[ai].val_off, 4);
            if (a == 0 || (a & (a - 1))) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: general.alignment %" PRIu32 " is not a power of two", a);
                goto done;
            }
            g->alignment = a;
        }
    }

    /* data section and tensor bounds */
    {
        uint64_t a = g->alignment, pos = r.pos;
        uint64_t data_off = pos + (a - pos % a) % a; /* pos < SIZE_MAX, a <= 2^31: no overflow */
        g->data_off = data_off;
        for (int64_t i = 0; i < g->n_tensors; i++) {
            cas_gguf_tensor *t = &g->tensors[i];
            if (t->offset % a) {
                st = cas_error(CAS_ERR_FORMAT, "gguf: tensor '%s' offset %" PRIu64 " is not aligned to %" PRIu64,
                               t->name, t->offset, a);
                goto done;
            }
            uint64_t avail = data_off <= g->size ? g->size - data_off : 0;
            if (t->nbytes && (data_off > g->size || t->offset > avail ||
                              (uint64_t)t->nbytes > avail - t->offset)) {
                st = cas_error(CAS_ERR_FORMAT,
                               "gguf: tensor '%s' (%zu bytes at data offset %" PRIu64
                               ") runs past the end of the %zu-byte file",
                               t->name, t->nbytes, t->offset, g->size);
                goto done;
            }
            t->data = t->nbytes ? g->base + data_off + t->offset : (const void *)g->base;
        }
    }
    st = CAS_OK;
done:
    cas_free(keys);
    cas_free(names);
    return st;
}

/* ---- open and close ---------------------------------------------------- */

static cas_status open_common(cas_gguf *g, cas_gguf **out) {
    cas_status st = parse(g);
    if (st) {
        cas_gguf_close(g);
        return st;
    }
    *out = g;
    return CAS_OK;
}

cas_status cas_gguf_open_memory(const void *data, size_t size, cas_gguf **out) {
    if (!out) return cas_error(CAS_ERR_INVALID, "gguf: out is NULL");
    *out = NULL;
    if (!data && size) return cas_error(CAS_ERR_INVALID, "gguf: data is NULL");
    cas_gguf *g = cas_alloc(sizeof *g);
    if (!g) return cas_error(CAS_ERR_NOMEM, "gguf: no memory");
    memset(g, 0, sizeof *g);
    g->base = data ? data : (const uint8_t *)"";
    g->size = size;
    return open_common(g, out);
}

/* The file read into anonymous memory on 2 MiB boundaries, advised as huge
 * pages: NULL (errno set) on failure. */
static void *read_whole(int fd, size_t size, size_t *map_bytes) {
    const size_t huge = (size_t)2 << 20, r = (size + huge - 1) & ~(huge - 1);
    void *p = mmap(NULL, r, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) return NULL;
#ifdef MADV_HUGEPAGE
    (void)madvise(p, r, MADV_HUGEPAGE);
#endif
    for (size_t done = 0; done < size;) {
        ssize_t k = pread(fd, (uint8_t *)p + done, size - done, (off_t)done);
        if (k < 0 && errno == EINTR) continue;
        if (k <= 0) {
            int e = k < 0 ? errno : EIO; /* the file shrank under us */
            munmap(p, r);
            errno = e;
            return NULL;
        }
        done += (size_t)k;
    }
    (void)mprotect(p, r, PROT_READ);
    *map_bytes = r;
    return p;
}

static cas_status open_file(const char *path, int read_in, cas_gguf **out) {
    if (!out || !path) return cas_error(CAS_ERR_INVALID, "gguf: path or out is NULL");
    *out = NULL;
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return cas_error(CAS_ERR_IO, "gguf: cannot open %s: %s", path, strerror(errno));
    struct stat sb;
    if (fstat(fd, &sb) != 0) {
        int e = errno;
        close(fd);
        return cas_error(CAS_ERR_IO, "gguf: cannot stat %s: %s", path, strerror(e));
    }
    if (!S_ISREG(sb.st_mode)) {
        close(fd);
        return cas_error(CAS_ERR_IO, "gguf: %s is not a regular file", path);
    }
    if (sb.st_size < 24) {
        close(fd);
        return cas_error(CAS_ERR_FORMAT, "gguf: %s is %lld bytes, too short for a GGUF header", path,
                         (long long)sb.st_size);
    }
    size_t size = (size_t)sb.st_size, map_bytes = size;
    void *p = read_in ? read_whole(fd, size, &map_bytes) : mmap(NULL, size, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (!p || p == MAP_FAILED)
        return cas_error(CAS_ERR_IO, "gguf: cannot %s %s: %s", read_in ? "read" : "map", path, strerror(e));
    cas_gguf *g = cas_alloc(sizeof *g);
    if (!g) {
        munmap(p, map_bytes);
        return cas_error(CAS_ERR_NOMEM, "gguf: no memory");
    }
    memset(g, 0, sizeof *g);
    g->base = p;
    g->size = size;
    g->mapped = 1;
    g->map_bytes = map_bytes;
    cas_status st = open_common(g, out);
    if (st) {
        /* keep the message but say which file */
        char msg[512];
        snprintf(msg, sizeof msg, "%s", cas_last_error());
        return cas_error(st, "%s: %s", path, msg);
    }
    return CAS_OK;
}

cas_status cas_gguf_open(const char *path, cas_gguf **out) { return open_file(path, 0, out); }

cas_status cas_gguf_open_read(const char *path, cas_gguf **out) { return open_file(path, 1, out); }

void cas_gguf_close(cas_gguf *g) {
    if (!g) return;
    if (g->kv)
        for (int64_t i = 0; i < g->n_kv; i++) cas_free((void *)g->kv[i].arr.offs_);
    cas_free(g->kv);
    cas_free(g->tensors);
    cas_free(g->arena);
    cas_free(g->kv_hash);
    cas_free(g->t_hash);
    if (g->mapped) munmap((void *)g->base, g->map_bytes);
    cas_free(g);
}

uint32_t cas_gguf_version(const cas_gguf *g) { return g->version; }
uint32_t cas_gguf_alignment(const cas_gguf *g) { return g->alignment; }
uint64_t cas_gguf_data_offset(const cas_gguf *g) { return g->data_off; }
size_t cas_gguf_file_size(const cas_gguf *g) { return g->size; }

/* ---- metadata ---------------------------------------------------------- */

int64_t cas_gguf_n_kv(const cas_gguf *g) { return g->n_kv; }

const char *cas_gguf_kv_key(const cas_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? g->kv[i].key : NULL;
}

int cas_gguf_kv_type(const cas_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_kv ? (int)g->kv[i].type : -1;
}

int64_t cas_gguf_find_kv(const cas_gguf *g, const char *key) {
    if (!g || !key) return -1;
    return hash_find(g->kv_hash, g->hash_cap, key, kv_name, g);
}

static cas_status lookup(const cas_gguf *g, const char *key, const kv_entry **e) {
    int64_t i = cas_gguf_find_kv(g, key);
    if (i < 0) return cas_error(CAS_ERR_FORMAT, "gguf: missing key '%s'", key ? key : "(null)");
    *e = &g->kv[i];
    return CAS_OK;
}

/* Reads an integer scalar at p of type t. *neg tells whether the value is
 * negative (then *sv holds it), else *uv holds it. 0 if t is not integral. */
static int read_int(const uint8_t *p, uint32_t t, int *neg, int64_t *sv, uint64_t *uv) {
    int64_t s = 0;
    uint64_t u = 0;
    int is_signed = 0;
    switch (t) {
    case CAS_GGUF_U8: case CAS_GGUF_BOOL: { uint8_t v; memcpy(&v, p, 1); u = v; break; }
    case CAS_GGUF_U16: { uint16_t v; memcpy(&v, p, 2); u = v; break; }
    case CAS_GGUF_U32: { uint32_t v; memcpy(&v, p, 4); u = v; break; }
    case CAS_GGUF_U64: { memcpy(&u, p, 8); break; }
    case CAS_GGUF_I8: { int8_t v; memcpy(&v, p, 1); s = v; is_signed = 1; break; }
    case CAS_GGUF_I16: { int16_t v; memcpy(&v, p, 2); s = v; is_signed = 1; break; }
    case CAS_GGUF_I32: { int32_t v; memcpy(&v, p, 4); s = v; is_signed = 1; break; }
    case CAS_GGUF_I64: { memcpy(&s, p, 8); is_signed = 1; break; }
    default: return 0;
    }
    if (is_signed && s < 0) {
        *neg = 1;
        *sv = s;
    } else {
        *neg = 0;
        *uv = is_signed ? (uint64_t)s : u;
    }
    return 1;
}

static cas_status get_int(const cas_gguf *g, const char *key, int64_t lo, uint64_t hi, int *neg,
                          int64_t *sv, uint64_t *uv) {
    const kv_entry *e = NULL;
    cas_status st = lookup(g, key, &e);
    if (st) return st;
    if (!read_int(g->base + e->val_off, e->type, neg, sv, uv))
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is %s, not an integer", key,
                         cas_gguf_type_name((int)e->type));
    if ((*neg && *sv < lo) || (!*neg && *uv > hi))
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' (%s) is out of range", key,
                         cas_gguf_type_name((int)e->type));
    return CAS_OK;
}

cas_status cas_gguf_get_u32(const cas_gguf *g, const char *key, uint32_t *out) {
    int neg; int64_t sv; uint64_t uv = 0;
    cas_status st = get_int(g, key, 0, UINT32_MAX, &neg, &sv, &uv);
    if (!st) *out = (uint32_t)uv;
    return st;
}

cas_status cas_gguf_get_i32(const cas_gguf *g, const char *key, int32_t *out) {
    int neg; int64_t sv = 0; uint64_t uv = 0;
    cas_status st = get_int(g, key, INT32_MIN, INT32_MAX, &neg, &sv, &uv);
    if (!st) *out = neg ? (int32_t)sv : (int32_t)uv;
    return st;
}

cas_status cas_gguf_get_u64(const cas_gguf *g, const char *key, uint64_t *out) {
    int neg; int64_t sv; uint64_t uv = 0;
    cas_status st = get_int(g, key, 0, UINT64_MAX, &neg, &sv, &uv);
    if (!st) *out = uv;
    return st;
}

cas_status cas_gguf_get_i64(const cas_gguf *g, const char *key, int64_t *out) {
    int neg; int64_t sv = 0; uint64_t uv = 0;
    cas_status st = get_int(g, key, INT64_MIN, INT64_MAX, &neg, &sv, &uv);
    if (!st) *out = neg ? sv : (int64_t)uv;
    return st;
}

cas_status cas_gguf_get_bool(const cas_gguf *g, const char *key, int *out) {
    const kv_entry *e = NULL;
    cas_status st = lookup(g, key, &e);
    if (st) return st;
    if (e->type != CAS_GGUF_BOOL)
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is %s, not bool", key,
                         cas_gguf_type_name((int)e->type));
    *out = g->base[e->val_off] != 0;
    return CAS_OK;
}

static int read_float(const uint8_t *p, uint32_t t, double *out) {
    if (t == CAS_GGUF_F32) {
        float f;
        memcpy(&f, p, 4);
        *out = f;
        return 1;
    }
    if (t == CAS_GGUF_F64) {
        memcpy(out, p, 8);
        return 1;
    }
    int neg;
    int64_t sv = 0;
    uint64_t uv = 0;
    if (t == CAS_GGUF_BOOL || !read_int(p, t, &neg, &sv, &uv)) return 0;
    *out = neg ? (double)sv : (double)uv;
    return 1;
}

cas_status cas_gguf_get_f64(const cas_gguf *g, const char *key, double *out) {
    const kv_entry *e = NULL;
    cas_status st = lookup(g, key, &e);
    if (st) return st;
    if (!read_float(g->base + e->val_off, e->type, out))
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is %s, not a number", key,
                         cas_gguf_type_name((int)e->type));
    return CAS_OK;
}

cas_status cas_gguf_get_f32(const cas_gguf *g, const char *key, float *out) {
    double d;
    cas_status st = cas_gguf_get_f64(g, key, &d);
    if (!st) *out = (float)d;
    return st;
}

cas_status cas_gguf_get_str(const cas_gguf *g, const char *key, const char **out, size_t *len) {
    const kv_entry *e = NULL;
    cas_status st = lookup(g, key, &e);
    if (st) return st;
    if (e->type != CAS_GGUF_STRING)
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is %s, not string", key,
                         cas_gguf_type_name((int)e->type));
    *out = e->str;
    if (len) *len = (size_t)e->str_len;
    return CAS_OK;
}

cas_status cas_gguf_get_arr(const cas_gguf *g, const char *key, int want, cas_gguf_arr *out) {
    const kv_entry *e = NULL;
    cas_status st = lookup(g, key, &e);
    if (st) return st;
    if (e->type != CAS_GGUF_ARRAY)
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is %s, not array", key,
                         cas_gguf_type_name((int)e->type));
    if (want >= 0 && (int)e->arr.type != want)
        return cas_error(CAS_ERR_FORMAT, "gguf: key '%s' is an array of %s, not of %s", key,
                         cas_gguf_type_name((int)e->arr.type), cas_gguf_type_name(want));
    *out = e->arr;
    return CAS_OK;
}

cas_status cas_gguf_arr_int(const cas_gguf_arr *a, uint64_t i, int64_t *out) {
    if (i >= a->n) return cas_error(CAS_ERR_INVALID, "gguf: array index %" PRIu64 " >= %" PRIu64, i, a->n);
    size_t es = scalar_size(a->type);
    int neg;
    int64_t sv = 0;
    uint64_t uv = 0;
    if (a->type == CAS_GGUF_F32 || a->type == CAS_GGUF_F64 || !es ||
        !read_int((const uint8_t *)a->data + i * es, a->type, &neg, &sv, &uv))
        return cas_error(CAS_ERR_INVALID, "gguf: array of %s read as integers",
                         cas_gguf_type_name((int)a->type));
    if (!neg && uv > (uint64_t)INT64_MAX)
        return cas_error(CAS_ERR_INVALID, "gguf: array element %" PRIu64 " exceeds int64", i);
    *out = neg ? sv : (int64_t)uv;
    return CAS_OK;
}

cas_status cas_gguf_arr_float(const cas_gguf_arr *a, uint64_t i, double *out) {
    if (i >= a->n) return cas_error(CAS_ERR_INVALID, "gguf: array index %" PRIu64 " >= %" PRIu64, i, a->n);
    size_t es = scalar_size(a->type);
    if (!es || !read_float((const uint8_t *)a->data + i * es, a->type, out))
        return cas_error(CAS_ERR_INVALID, "gguf: array of %s read as numbers",
                         cas_gguf_type_name((int)a->type));
    return CAS_OK;
}

cas_status cas_gguf_arr_str(const cas_gguf_arr *a, uint64_t i, cas_gguf_str *out) {
    if (a->type != CAS_GGUF_STRING || !a->offs_)
        return cas_error(CAS_ERR_INVALID, "gguf: array of %s read as strings",
                         cas_gguf_type_name((int)a->type));
    if (i >= a->n) return cas_error(CAS_ERR_INVALID, "gguf: array index %" PRIu64 " >= %" PRIu64, i, a->n);
    const uint8_t *p = a->base_ + a->offs_[i];
    memcpy(&out->len, p, 8); /* validated at open */
    out->ptr = (const char *)p + 8;
    return CAS_OK;
}

/* ---- tensors ----------------------------------------------------------- */

int64_t cas_gguf_n_tensors(const cas_gguf *g) { return g->n_tensors; }

const cas_gguf_tensor *cas_gguf_tensor_at(const cas_gguf *g, int64_t i) {
    return i >= 0 && i < g->n_tensors ? &g->tensors[i] : NULL;
}

const cas_gguf_tensor *cas_gguf_find_tensor(const cas_gguf *g, const char *name) {
    if (!g || !name) return NULL;
    int64_t i = hash_find(g->t_hash, g->hash_cap, name, tensor_name, g);
    return i >= 0 ? &g->tensors[i] : NULL;
}
