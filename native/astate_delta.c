/*
 * astate_store._delta: change maps of delta versions (docs/delta.md), in C because they touch
 * every byte of a model.
 *
 *   stage(shards, tiles, threads, streaming)  the put's compare-and-copy into a staging slot:
 *       one pass that copies every shard, compares it with the previous version (raw bits, 64
 *       bytes at a time: AVX-512 where the CPU has it, else SSE2), encodes each tile's changes
 *       into per-thread arenas and hashes each tile (XXH3-64). Returns an Arena; tiles[] says,
 *       per tile, what was found and where its bytes are.
 *   place(arena, rows)                         copy encoded tiles from the arena to the slot.
 *   decode(geoms, tiles, threads, check)      the pull's side, in two passes so that nothing is
 *       written before every tile was checked: pass A (check=1) checks every tile (for buffers
 *       decode cannot write itself, it also reports each element's buffer offset and value into
 *       the out_off / out_val arrays); pass B (check=0) decodes the tiles of host buffers again
 *       and writes each value in place.
 *   digest(geoms, tiles, out, threads)         XXH3-64 of whole tiles of destination memory.
 *   load_xxh3(path)                            XXH3_64bits (its runtime-dispatched build where
 *       present), from the xxhash package's extension (a declared dependency: called through
 *       its exported C API, not copied).
 *
 * A tile's digest is XXH3-64 of its bytes, its rows in order: where they are not one run of
 * memory (a column block), the compare-and-copy gathers each row while it is in cache.
 *
 * The tile geometry and the row format are defined in astate_store/model/delta_format.py; the
 * Python layer computes and checks every address it passes here (the publisher its own
 * memory; the consumer its scratch and buffers). decode() checks everything that comes from a
 * peer (counts, encodings, lengths, every index) before it writes a byte.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
#else
#define HAVE_STREAM 0
#endif

#define TILE_BYTES (32u << 10) /* delta_format.TILE_BYTES: a tile's bytes at most */
#define UNIT_BLOCKS 8          /* column blocks of one band handled by one work unit */
#define MAX_JOBS 16
#define ENC_NONE 0
#define ENC_VARINT 1
#define ENC_BITMAP 2
#define ENC_RAW 3
#define ENC_SHIFT 56
#define COUNT_MASK ((1ull << ENC_SHIFT) - 1)

/* ---------------------------------------------------------------- XXH3 through the xxhash package */

typedef uint64_t (*xxh3_fn)(const void *, size_t);

static struct {
    xxh3_fn oneshot; /* XXH3_64bits */
} H;

static PyObject *mod_load_xxh3(PyObject *m, PyObject *arg)
{
    const char *path = PyUnicode_AsUTF8(arg);
    if (path == NULL) return NULL;
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (h == NULL) Py_RETURN_FALSE;
    /* the runtime-dispatched variant (AVX2 / AVX-512 where the CPU has them) when the package
     * was built with it: the same function, about twice as fast as its SSE2 build here */
    H.oneshot = (xxh3_fn)dlsym(h, "XXH3_64bits_dispatch");
    if (!H.oneshot) H.oneshot = (xxh3_fn)dlsym(h, "XXH3_64bits");
    if (!H.oneshot) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

/* ---------------------------------------------------------------- helpers */

static void run_jobs(void *(*fn)(void *), void *jobs, size_t job_size, int nj)
{
    pthread_t tids[MAX_JOBS];
    int started[MAX_JOBS] = {0};
    char *base = jobs;
    if (nj > MAX_JOBS) nj = MAX_JOBS;
    for (int t = 1; t < nj; t++) started[t] = pthread_create(&tids[t], NULL, fn, base + (size_t)t * job_size) == 0;
    for (int t = 1; t < nj; t++)
        if (!started[t]) fn(base + (size_t)t * job_size);
    fn(base);
    for (int t = 1; t < nj; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}

/* a C-contiguous (n, ncols) array of 64-bit integers, or -1 with ValueError */
static int get_table(PyObject *obj, Py_buffer *pb, Py_ssize_t ncols, const char *what, int writable)
{
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(obj, pb, flags) != 0) return -1;
    const char *fmt = pb->format ? pb->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (pb->itemsize != 8 || strchr("qQlL", fmt[0]) == NULL || fmt[1] != 0 || pb->ndim != 2 ||
        pb->shape[1] != ncols) {
        PyBuffer_Release(pb);
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous 2-D array of 64-bit integers with %zd columns",
                     what, ncols);
        return -1;
    }
    return 0;
}

static inline size_t leb_len(uint64_t v)
{
    size_t n = 1;
    while (v >= 0x80) v >>= 7, n++;
    return n;
}

static inline int elem_differs(const unsigned char *a, const unsigned char *b, size_t esize)
{
    switch (esize) {
    case 1: return a[0] != b[0];
    case 2: { uint16_t x, y; memcpy(&x, a, 2); memcpy(&y, b, 2); return x != y; }
    case 4: { uint32_t x, y; memcpy(&x, a, 4); memcpy(&y, b, 4); return x != y; }
    case 8: { uint64_t x, y; memcpy(&x, a, 8); memcpy(&y, b, 8); return x != y; }
    default: return memcmp(a, b, esize) != 0;
    }
}

/* esize bytes (1, 2, 4 or 8: every dtype moved) as one load and store */
static inline void elem_copy(unsigned char *d, const unsigned char *s, size_t esize)
{
    switch (esize) {
    case 1: *d = *s; break;
    case 2: memcpy(d, s, 2); break;
    case 4: memcpy(d, s, 4); break;
    default: memcpy(d, s, 8); break;
    }
}

/* ---------------------------------------------------------------- stage: compare-and-copy */

/* shard rows: src, dst, prev (0: no base), esize, C, TC, gc, P, TB, gb, nbands, tile_base */
#define SH_COLS 12
/* tile rows written: count | enc << 56, encoded length, digest, arena location (thread << 48 | offset) */
#define TL_COLS 4

typedef void (*segment_fn)(const unsigned char *, const unsigned char *, unsigned char *, size_t, size_t, uint32_t,
                           uint32_t *, unsigned char *, size_t *, int, unsigned char *);

typedef struct {
    unsigned char *buf;
    size_t len, cap;
    int failed;
} arena_t;

typedef struct {
    const uint64_t *shards;
    size_t nshards;
    const uint64_t *unit_start; /* per shard: its first unit; [nshards] = total */
    uint64_t *tiles;
    int streaming;
    size_t next;       /* next unit (atomic) */
    segment_fn segment; /* stage_segment, or its AVX-512 build where the CPU has it */
} stage_t;


typedef struct {
    uint32_t *idx;       /* UNIT_BLOCKS tiles x TILE_BYTES indices */
    unsigned char *vals; /* UNIT_BLOCKS tiles x TILE_BYTES value bytes */
    unsigned char *tmp;  /* UNIT_BLOCKS tiles x TILE_BYTES: a column block's rows gathered, to hash */
    size_t n[UNIT_BLOCKS];
} tilebuf_t;

typedef struct {
    arena_t arena;
    tilebuf_t tb;
} stage_room_t; /* one thread's buffers, kept from put to put (no page faults in steady state) */

typedef struct {
    stage_t *S;
    int tid;
    stage_room_t *room;
    int nomem;
} stage_job_t;

static void store_block(unsigned char *d, const unsigned char *s, size_t n, int streaming)
{
#if HAVE_STREAM
    if (streaming && n == 64 && ((uintptr_t)d & 15) == 0) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(s));
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(s + 48));
        _mm_stream_si128((__m128i *)(d), a);
        _mm_stream_si128((__m128i *)(d + 16), b);
        _mm_stream_si128((__m128i *)(d + 32), c);
        _mm_stream_si128((__m128i *)(d + 48), e);
        return;
    }
#endif
    memcpy(d, s, n);
}

/* Bit i set where element i of a 64-byte block differs (raw bits): SSE2 compares where there
 * are, else words. esize is 1, 2, 4 or 8, so a block holds 64 / esize elements. */
static inline uint64_t block_diff(const unsigned char *a, const unsigned char *b, size_t esize)
{
#if defined(__SSE2__)
    uint64_t eq = 0;
    for (int q = 0; q < 4; q++) {
        const __m128i x = _mm_loadu_si128((const __m128i *)(a + 16 * q));
        const __m128i y = _mm_loadu_si128((const __m128i *)(b + 16 * q));
        uint64_t m;
        switch (esize) {
        case 1: m = (uint64_t)_mm_movemask_epi8(_mm_cmpeq_epi8(x, y)); eq |= m << (16 * q); break;
        case 2: m = (uint64_t)_mm_movemask_epi8(_mm_packs_epi16(_mm_cmpeq_epi16(x, y), _mm_setzero_si128()));
            eq |= (m & 0xff) << (8 * q); break;
        case 4: m = (uint64_t)_mm_movemask_ps(_mm_castsi128_ps(_mm_cmpeq_epi32(x, y))); eq |= m << (4 * q); break;
        default: { /* 8: both 32-bit halves equal */
            const __m128i c = _mm_cmpeq_epi32(x, y);
            const __m128i both = _mm_and_si128(c, _mm_shuffle_epi32(c, 0xb1));
            m = (uint64_t)_mm_movemask_pd(_mm_castsi128_pd(both));
            eq |= m << (2 * q);
        }
        }
    }
    const unsigned n = (unsigned)(64 / esize);
    const uint64_t all = n == 64 ? ~0ull : ((1ull << n) - 1);
    return ~eq & all;
#else
    uint64_t d = 0;
    for (size_t e = 0, i = 0; e < 64; e += esize, i++) d |= (uint64_t)elem_differs(a + e, b + e, esize) << i;
    return d;
#endif
}

/* elements [i, j) of a segment one by one: copy (unless in place) and record those that differ */
static inline size_t stage_elems(const unsigned char *s, const unsigned char *p, unsigned char *d, size_t i, size_t j,
                                 size_t esize, uint32_t base, uint32_t *idx, unsigned char *vals, size_t n)
{
    const int inplace = p == d;
    for (; i < j; i += esize) {
        if (elem_differs(s + i, p + i, esize)) {
            idx[n] = base + (uint32_t)(i / esize);
            memcpy(vals + n * esize, s + i, esize);
            n++;
            if (inplace) memcpy(d + i, s + i, esize);
        }
        if (!inplace) memcpy(d + i, s + i, esize);
    }
    return n;
}

/* the elements set in m (those of the 64-byte block at s + i) into idx / vals */
static inline size_t take_changes(uint64_t m, const unsigned char *s, size_t i, size_t esize, uint32_t base,
                                  uint32_t *idx, unsigned char *vals, size_t n)
{
    const uint32_t first = base + (uint32_t)(i / esize);
    while (m) {
        const unsigned e = (unsigned)__builtin_ctzll(m);
        m &= m - 1;
        idx[n] = first + e;
        elem_copy(vals + n * esize, s + i + (size_t)e * esize, esize);
        n++;
    }
    return n;
}

/* One row segment of one tile: copy src to dst and record the elements that differ from prev
 * (NULL: no base, a plain copy). The segment's head up to d's next line, and its tail, go
 * element by element; the lines between are compared 64 bytes at a time and, with streaming,
 * written with non-temporal stores (whole lines only: a partial one would cost a read). */
static void stage_segment(const unsigned char *s, const unsigned char *p, unsigned char *d, size_t w, size_t esize,
                          uint32_t base, uint32_t *idx, unsigned char *vals, size_t *np, int streaming,
                          unsigned char *gather)
{
    if (gather != NULL) memcpy(gather, s, w * esize);
    const size_t nb = w * esize;
    size_t h = (64 - ((uintptr_t)d & 63)) & 63;
    h -= h % esize;
    if (h > nb) h = nb;
    const size_t body = h + (nb - h) / 64 * 64;
    if (p == NULL) { /* no base: a plain copy */
        memcpy(d, s, h);
        for (size_t i = h; i < body; i += 64) store_block(d + i, s + i, 64, streaming);
        memcpy(d + body, s + body, nb - body);
        return;
    }
    const int inplace = p == d;
    size_t n = stage_elems(s, p, d, 0, h, esize, base, idx, vals, *np);
    for (size_t i = h; i < body; i += 64) {
        const uint64_t m = block_diff(s + i, p + i, esize);
        if (!inplace) store_block(d + i, s + i, 64, streaming);
        else if (m) memcpy(d + i, s + i, 64);
        if (m) n = take_changes(m, s, i, esize, base, idx, vals, n);
    }
    *np = stage_elems(s, p, d, body, nb, esize, base, idx, vals, n);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define HAVE_AVX512 1
/* The same with AVX-512BW (one compare to a mask per 64 bytes, 64-byte streaming stores): the
 * compare and the copy cost a few instructions per line, so the pass runs at memory speed. */
__attribute__((target("avx512f,avx512bw"))) static void stage_segment_avx512(
    const unsigned char *s, const unsigned char *p, unsigned char *d, size_t w, size_t esize, uint32_t base,
    uint32_t *idx, unsigned char *vals, size_t *np, int streaming, unsigned char *gather)
{
    const size_t nb = w * esize;
    if (gather != NULL && p == NULL) memcpy(gather, s, nb);
    size_t h = (64 - ((uintptr_t)d & 63)) & 63;
    h -= h % esize;
    if (h > nb) h = nb;
    const size_t body = h + (nb - h) / 64 * 64;
    if (p == NULL) {
        memcpy(d, s, h);
        for (size_t i = h; i < body; i += 64) {
            const __m512i x = _mm512_loadu_si512((const void *)(s + i));
            if (streaming) _mm512_stream_si512((void *)(d + i), x);
            else _mm512_store_si512((void *)(d + i), x);
        }
        memcpy(d + body, s + body, nb - body);
        return;
    }
    const int inplace = p == d;
    if (gather != NULL) { /* the head and tail here, the lines as they pass */
        memcpy(gather, s, h);
        memcpy(gather + body, s + body, nb - body);
    }
    size_t n = stage_elems(s, p, d, 0, h, esize, base, idx, vals, *np);
    for (size_t i = h; i < body; i += 64) {
        const __m512i x = _mm512_loadu_si512((const void *)(s + i));
        const __m512i y = _mm512_loadu_si512((const void *)(p + i));
        if (gather != NULL) _mm512_storeu_si512((void *)(gather + i), x);
        uint64_t m;
        switch (esize) {
        case 1: m = _mm512_cmpneq_epi8_mask(x, y); break;
        case 2: m = _mm512_cmpneq_epi16_mask(x, y); break;
        case 4: m = _mm512_cmpneq_epi32_mask(x, y); break;
        default: m = _mm512_cmpneq_epi64_mask(x, y); break;
        }
        if (!inplace) {
            if (streaming) _mm512_stream_si512((void *)(d + i), x);
            else _mm512_store_si512((void *)(d + i), x);
        } else if (m) {
            _mm512_store_si512((void *)(d + i), x);
        }
        if (m) n = take_changes(m, s, i, esize, base, idx, vals, n);
    }
    *np = stage_elems(s, p, d, body, nb, esize, base, idx, vals, n);
}

#define SEGMENT_AVX512 stage_segment_avx512
#else
#define HAVE_AVX512 0
#define SEGMENT_AVX512 stage_segment
#endif

static int has_avx512(void)
{
#if HAVE_AVX512
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw");
#else
    return 0;
#endif
}

static int arena_reserve(arena_t *a, size_t more)
{
    if (a->len + more <= a->cap) return 0;
    size_t cap = a->cap ? a->cap : (1u << 20);
    while (cap < a->len + more) cap *= 2;
    unsigned char *nb = realloc(a->buf, cap);
    if (nb == NULL) return -1;
    a->buf = nb, a->cap = cap;
    return 0;
}

/* Encode one finished tile into the thread's arena, in one pass: the gaps as LEB128 (at most 3
 * bytes each: a tile has fewer than 2^21 elements), or a bitmap when that is smaller; raw when
 * neither beats the tile itself. Fills the tile's row of the tiles table. */
static void finish_tile(stage_job_t *J, uint64_t *row, const uint32_t *idx, const unsigned char *vals, size_t n,
                        size_t elems, size_t esize, int has_base)
{
    uint64_t enc = ENC_RAW, count = n, len = 0, loc = 0;
    const size_t blen = (elems + 7) / 8, vbytes = n * esize;
    if (!has_base) {
        count = elems;
    } else if (n == 0) {
        enc = ENC_NONE;
    } else if (vbytes + (n < blen ? n : blen) < elems * esize) { /* some encoding can be smaller */
        arena_t *a = &J->room->arena;
        if (arena_reserve(a, 3 * n + blen + vbytes) != 0) {
            J->nomem = 1; /* an arena that cannot grow: the tile goes raw */
        } else {
            unsigned char *o = a->buf + a->len, *q = o;
            size_t ilen = blen;
            if (n < blen) { /* at least one byte per gap: a varint stream can only be smaller */
                uint32_t next = 0; /* the first index not yet covered */
                for (size_t k = 0; k < n; k++) {
                    uint32_t g = idx[k] - next;
                    next = idx[k] + 1;
                    while (g >= 0x80) *q++ = (unsigned char)(g | 0x80), g >>= 7;
                    *q++ = (unsigned char)g;
                }
                ilen = (size_t)(q - o);
            }
            const int bitmap = ilen >= blen;
            if (bitmap) {
                ilen = blen;
                memset(o, 0, blen);
                for (size_t k = 0; k < n; k++) o[idx[k] >> 3] |= (unsigned char)(1u << (idx[k] & 7));
            }
            if (ilen + vbytes < elems * esize) {
                memcpy(o + ilen, vals, vbytes);
                enc = bitmap ? ENC_BITMAP : ENC_VARINT;
                len = ilen + vbytes;
                loc = ((uint64_t)J->tid << 48) | (uint64_t)a->len;
                a->len += len;
            }
        }
    }
    row[0] = count | (enc << ENC_SHIFT);
    row[1] = len;
    row[3] = loc;
}

/* One unit: a band of a shard, the column blocks cb0.. of it, row by row (the rows are read in
 * memory order). A tile that is one run of the shard is hashed where it lies, in cache after
 * the pass; the rows of a column block are gathered while in cache, and hashed together. */
static void stage_unit(stage_job_t *J, size_t u)
{
    stage_t *S = J->S;
    size_t lo = 0, hi = S->nshards;
    while (hi - lo > 1) { /* the shard whose units hold u */
        size_t mid = (lo + hi) / 2;
        if (S->unit_start[mid] <= u) lo = mid;
        else hi = mid;
    }
    const uint64_t *sh = S->shards + SH_COLS * lo;
    const unsigned char *src = (const unsigned char *)(uintptr_t)sh[0];
    unsigned char *dst = (unsigned char *)(uintptr_t)sh[1];
    const unsigned char *prev = (const unsigned char *)(uintptr_t)sh[2];
    const size_t esize = sh[3], C = sh[4], TC = sh[5], gc = sh[6], P = sh[7], TB = sh[8], gb = sh[9],
                 nbands = sh[10], tile_base = sh[11];
    const size_t groups = (gc + UNIT_BLOCKS - 1) / UNIT_BLOCKS;
    const size_t local = u - S->unit_start[lo];
    const size_t j = local / groups, cb0 = (local % groups) * UNIT_BLOCKS;
    const size_t cb1 = cb0 + UNIT_BLOCKS < gc ? cb0 + UNIT_BLOCKS : gc;
    const size_t lead = j / gb, blk = j % gb;
    const size_t row0 = lead * P + blk * TB;
    const size_t nrows = TB < P - blk * TB ? TB : P - blk * TB;
    const int contiguous = gc == 1 || nrows == 1; /* each tile one run of memory */
    tilebuf_t *tb = &J->room->tb;
    const int hashing = H.oneshot != NULL;
    for (size_t cb = cb0; cb < cb1; cb++) tb->n[cb - cb0] = 0;
    for (size_t r = row0; r < row0 + nrows; r++) {
        for (size_t cb = cb0; cb < cb1; cb++) {
            const size_t c0 = cb * TC, w = TC < C - c0 ? TC : C - c0, i = cb - cb0;
            const size_t off = (r * C + c0) * esize;
            unsigned char *gather = hashing && !contiguous ? tb->tmp + i * TILE_BYTES + (r - row0) * w * esize : NULL;
            S->segment(src + off, prev ? prev + off : NULL, dst + off, w, esize, (uint32_t)((r - row0) * w),
                       tb->idx + i * TILE_BYTES, tb->vals + i * TILE_BYTES, &tb->n[i], S->streaming, gather);
        }
    }
    for (size_t cb = cb0; cb < cb1; cb++) {
        const size_t c0 = cb * TC, w = TC < C - c0 ? TC : C - c0, i = cb - cb0;
        uint64_t *row = S->tiles + TL_COLS * (tile_base + cb * nbands + j);
        const unsigned char *bytes = contiguous ? src + (row0 * C + c0) * esize : tb->tmp + i * TILE_BYTES;
        row[2] = hashing ? H.oneshot(bytes, nrows * w * esize) : 0;
        finish_tile(J, row, tb->idx + i * TILE_BYTES, tb->vals + i * TILE_BYTES, tb->n[i], nrows * w, esize,
                    prev != NULL);
    }
}

static void *stage_worker(void *arg)
{
    stage_job_t *J = arg;
    const size_t total = J->S->unit_start[J->S->nshards];
    size_t u;
    while ((u = __atomic_fetch_add(&J->S->next, 1, __ATOMIC_RELAXED)) < total) stage_unit(J, u);
#if HAVE_STREAM
    if (J->S->streaming) _mm_sfence();
#endif
    return NULL;
}

/* every thread's buffers: the arenas of the last stage() call (until place() copied them out)
 * and the tile buffers, reused by the next stage() given them */
typedef struct {
    int n;
    stage_room_t t[MAX_JOBS];
} arenas_t;

static void arenas_free(PyObject *cap)
{
    arenas_t *A = PyCapsule_GetPointer(cap, "astate_delta.arenas");
    if (A == NULL) return;
    for (int t = 0; t < MAX_JOBS; t++) {
        free(A->t[t].arena.buf);
        free(A->t[t].tb.idx);
        free(A->t[t].tb.vals);
        free(A->t[t].tb.tmp);
    }
    free(A);
}

static int room_ready(stage_room_t *r)
{
    r->arena.len = 0;
    if (r->tb.idx == NULL) r->tb.idx = malloc((size_t)UNIT_BLOCKS * TILE_BYTES * sizeof(uint32_t));
    if (r->tb.vals == NULL) r->tb.vals = malloc((size_t)UNIT_BLOCKS * TILE_BYTES);
    if (r->tb.tmp == NULL) r->tb.tmp = malloc((size_t)UNIT_BLOCKS * TILE_BYTES);
    return r->tb.idx && r->tb.vals && r->tb.tmp ? 0 : -1;
}

/* the units (shard, band, group of column blocks) of every shard: unit_start[s] is shard s's
 * first; 0 when every row names tiles inside the table, -1 otherwise */
static int count_units(const uint64_t *shards, size_t ns, uint64_t ntiles, uint64_t *unit_start)
{
    uint64_t acc = 0;
    for (size_t s = 0; s < ns; s++) {
        const uint64_t *r = shards + SH_COLS * s;
        unit_start[s] = acc;
        acc += r[10] * ((r[6] + UNIT_BLOCKS - 1) / UNIT_BLOCKS);
        if (r[3] == 0 || r[3] > 8 || r[11] + r[10] * r[6] > ntiles) return -1;
    }
    unit_start[ns] = acc;
    return 0;
}

static PyObject *mod_stage(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"shards", "tiles", "threads", "streaming", "arenas", "simd", NULL};
    PyObject *sh_obj, *tl_obj, *cap = Py_None;
    int threads = 1, streaming = 0, simd = 1; /* simd 0: the SSE2 build even where AVX-512 runs (tests) */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|iiOi", kwlist, &sh_obj, &tl_obj, &threads, &streaming, &cap,
                                     &simd))
        return NULL;
    arenas_t *A = NULL;
    if (cap != Py_None && (A = PyCapsule_GetPointer(cap, "astate_delta.arenas")) == NULL) return NULL;
    Py_buffer sb, tb;
    if (get_table(sh_obj, &sb, SH_COLS, "shards", 0) != 0) return NULL;
    if (get_table(tl_obj, &tb, TL_COLS, "tiles", 1) != 0) {
        PyBuffer_Release(&sb);
        return NULL;
    }
    threads = threads < 1 ? 1 : threads > MAX_JOBS ? MAX_JOBS : threads;
    const size_t ns = (size_t)sb.shape[0];
    uint64_t *unit_start = PyMem_RawMalloc((ns + 1) * sizeof(uint64_t));
    PyObject *out = NULL;
    if (unit_start == NULL) {
        PyErr_NoMemory();
    } else if (count_units(sb.buf, ns, (uint64_t)tb.shape[0], unit_start) != 0) {
        PyErr_SetString(PyExc_ValueError, "stage: a shard row names tiles outside the table or a bad element size");
    } else if (A == NULL && (A = calloc(1, sizeof(arenas_t))) == NULL) {
        PyErr_NoMemory();
    } else {
        out = cap != Py_None ? (Py_INCREF(cap), cap) : PyCapsule_New(A, "astate_delta.arenas", arenas_free);
        if (out == NULL) free(A);
    }
    if (out != NULL) {
        stage_t S = {sb.buf, ns, unit_start, tb.buf, streaming && HAVE_STREAM, 0, simd && has_avx512() ? SEGMENT_AVX512 : stage_segment};
        const uint64_t units = unit_start[ns];
        const int nj = units <= 1 ? 1 : (uint64_t)threads > units ? (int)units : threads;
        stage_job_t jobs[MAX_JOBS];
        int nomem = 0;
        for (int t = 0; t < nj; t++) {
            jobs[t] = (stage_job_t){&S, t, &A->t[t], 0};
            nomem |= room_ready(&A->t[t]);
        }
        for (int t = nj; t < MAX_JOBS; t++) A->t[t].arena.len = 0;
        A->n = nj;
        if (!nomem) {
            Py_BEGIN_ALLOW_THREADS
            run_jobs(stage_worker, jobs, sizeof(stage_job_t), nj);
            Py_END_ALLOW_THREADS
        }
        if (nomem) {
            Py_DECREF(out);
            out = PyErr_NoMemory();
        }
    }
    PyMem_RawFree(unit_start);
    PyBuffer_Release(&sb);
    PyBuffer_Release(&tb);
    return out;
}

/* place(arenas, rows): rows (loc, len, dst_addr) copy encoded tiles out of the arenas */
static PyObject *mod_place(PyObject *m, PyObject *args)
{
    PyObject *cap, *rows_obj;
    if (!PyArg_ParseTuple(args, "OO", &cap, &rows_obj)) return NULL;
    arenas_t *A = PyCapsule_GetPointer(cap, "astate_delta.arenas");
    if (A == NULL) return NULL;
    Py_buffer rb;
    if (get_table(rows_obj, &rb, 3, "rows", 0) != 0) return NULL;
    const uint64_t *rows = rb.buf;
    const size_t n = (size_t)rb.shape[0];
    for (size_t i = 0; i < n; i++) { /* every row inside its arena: checked before any copy */
        const uint64_t t = rows[3 * i] >> 48, off = rows[3 * i] & ((1ull << 48) - 1);
        if ((int)t >= A->n || off + rows[3 * i + 1] > A->t[t].arena.len) {
            PyBuffer_Release(&rb);
            PyErr_Format(PyExc_ValueError, "place: row %zu is outside the arenas", i);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < n; i++) {
        const uint64_t t = rows[3 * i] >> 48, off = rows[3 * i] & ((1ull << 48) - 1);
        memcpy((void *)(uintptr_t)rows[3 * i + 2], A->t[t].arena.buf + off, rows[3 * i + 1]);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&rb);
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- decode: the pull's side */

/* geometry of one (source shard, destination box) pair:
 * esize, C, TC, nbands, gb, P, TB, row_map, c0, c1, col_stride, dest (0: output arrays) */
#define GE_COLS 12
/* tiles: geom, tile id, data address, count | enc << 56, data length, out_off address, out_val address */
#define TD_COLS 7

typedef struct {
    const int64_t *geoms;
    size_t ngeoms;
    const int64_t *tiles;
    size_t ntiles;
    int check;
    size_t next;
    size_t bad;     /* first bad tile + 1 (0: none); atomic min */
    size_t written; /* elements written inside their boxes (atomic) */
    int simd;       /* pass A's varint check with AVX-512 */
} decode_t;

typedef struct {
    decode_t *D;
} decode_job_t;

typedef struct {
    size_t row0, nrows, c0, w;
} tile_geo_t;

static int tile_geo(const int64_t *g, int64_t k, tile_geo_t *t)
{
    const int64_t C = g[1], TC = g[2], nbands = g[3], gb = g[4], P = g[5], TB = g[6];
    if (TC <= 0 || nbands <= 0 || gb <= 0 || k < 0) return -1;
    const int64_t gc = (C + TC - 1) / TC;
    if (k >= nbands * gc) return -1;
    const int64_t cb = k / nbands, j = k % nbands, lead = j / gb, blk = j % gb;
    t->row0 = (size_t)(lead * P + blk * TB);
    t->nrows = (size_t)(TB < P - blk * TB ? TB : P - blk * TB);
    t->c0 = (size_t)(cb * TC);
    t->w = (size_t)(TC < C - cb * TC ? TC : C - cb * TC);
    return 0;
}

/* Where a tile's elements go: element (r, c) of the shard (2-D view) lands at buffer element
 * row_map[r] + (c - c0) * col_stride when the buffer's box holds it (row_map[r] >= 0, c0 <= c < c1).
 * The cursor walks a tile's elements in increasing tile-local order without a division each. */
typedef struct {
    const int64_t *row_map;
    int64_t c0, c1, col_stride;
    unsigned char *dest; /* NULL: output arrays */
    size_t esize;
    size_t r, c;         /* current element: shard row, shard column */
    size_t w, tc0;       /* the tile's columns */
    int64_t m;           /* row_map[r] */
    size_t k, in;        /* elements reported, and written inside the box */
    int64_t *out_off;
    unsigned char *out_val;
} cursor_t;

static void cursor_init(cursor_t *q, const int64_t *g, const tile_geo_t *t, int64_t *out_off, unsigned char *out_val)
{
    q->row_map = (const int64_t *)(uintptr_t)g[7];
    q->c0 = g[8], q->c1 = g[9], q->col_stride = g[10];
    q->dest = (unsigned char *)(uintptr_t)g[11];
    q->esize = (size_t)g[0];
    q->r = t->row0, q->c = t->c0, q->w = t->w, q->tc0 = t->c0;
    q->m = q->row_map[q->r];
    q->k = q->in = 0;
    q->out_off = out_off, q->out_val = out_val;
}

/* move forward by `step` tile-local elements */
static inline void cursor_skip(cursor_t *q, size_t step)
{
    size_t c = q->c - q->tc0 + step;
    if (c >= q->w) {
        const size_t rows = c / q->w;
        q->r += rows;
        c -= rows * q->w;
        q->m = q->row_map[q->r];
    }
    q->c = q->tc0 + c;
}

/* the buffer element of the current element, or -1 outside the box */
static inline int64_t cursor_at(const cursor_t *q)
{
    const int inside = q->m >= 0 && (int64_t)q->c >= q->c0 && (int64_t)q->c < q->c1;
    return inside ? q->m + ((int64_t)q->c - q->c0) * q->col_stride : -1;
}

/* a raw tile: the box's part of it, row by row, as read into data; pass A checks its length
 * (and reports its elements to output arrays), pass B writes it into host memory */
static int decode_raw(const int64_t *g, const tile_geo_t *t, const unsigned char *data, size_t len, int pass,
                      cursor_t *q)
{
    const size_t esize = (size_t)g[0];
    const int64_t *row_map = (const int64_t *)(uintptr_t)g[7];
    const size_t lo = (size_t)(g[8] > (int64_t)t->c0 ? g[8] : (int64_t)t->c0);
    const size_t hi = (size_t)(g[9] < (int64_t)(t->c0 + t->w) ? g[9] : (int64_t)(t->c0 + t->w));
    const size_t wi = hi > lo ? hi - lo : 0;
    size_t rows_in = 0;
    for (size_t r = t->row0; r < t->row0 + t->nrows; r++) rows_in += row_map[r] >= 0;
    if (len != rows_in * wi * esize) return -1;
    if (pass == 0) q->in += rows_in * wi;
    if ((pass == 0) != (q->dest == NULL) || !wi) return 0; /* output arrays in pass A, memory in B */
    const unsigned char *v = data;
    for (size_t r = t->row0; r < t->row0 + t->nrows; r++) {
        if (row_map[r] < 0) continue;
        q->r = r, q->m = row_map[r];
        if (q->dest != NULL && q->col_stride == 1) { /* one run per row */
            memcpy(q->dest + (q->m + ((int64_t)lo - q->c0)) * (int64_t)esize, v, wi * esize);
            v += wi * esize;
            continue;
        }
        for (size_t c = lo; c < hi; c++, v += esize) {
            q->c = c;
            if (q->dest != NULL) {
                elem_copy(q->dest + cursor_at(q) * (int64_t)esize, v, esize);
            } else {
                q->out_off[q->k] = cursor_at(q);
                elem_copy(q->out_val + q->k * esize, v, esize);
                q->k++;
            }
        }
    }
    return 0;
}

/* pass A of an encoded tile: every index checked, each element's buffer offset (-1: outside the
 * box) reported to out_off, and its value to out_val for output arrays */
static inline int report(cursor_t *q, size_t n, const unsigned char *vals)
{
    const int64_t at = cursor_at(q);
    if (q->out_off == NULL) { /* a host buffer: pass B decodes again and writes */
        q->in += at >= 0;
        return 0;
    }
    q->out_off[n] = at;
    q->in += at >= 0;
    if (q->dest == NULL) elem_copy(q->out_val + n * q->esize, vals + n * q->esize, q->esize);
    return 0;
}

static int check_coded(const tile_geo_t *t, uint64_t enc, size_t count, const unsigned char *data, size_t ilen,
                       const unsigned char *vals, cursor_t *q)
{
    const size_t elems = t->nrows * t->w;
    size_t n = 0;
    int64_t last = -1;
    if (enc == ENC_VARINT) {
        size_t p = 0;
        while (n < count) {
            uint64_t gap = 0;
            int shift = 0;
            for (;;) {
                if (p >= ilen || shift > 56) return -1;
                const unsigned char b = data[p++];
                gap |= (uint64_t)(b & 0x7f) << shift;
                shift += 7;
                if (!(b & 0x80)) break;
            }
            if (gap >= elems || last + 1 + (int64_t)gap >= (int64_t)elems) return -1;
            cursor_skip(q, (size_t)(last < 0 ? gap : gap + 1));
            report(q, n++, vals);
            last += 1 + (int64_t)gap;
        }
        return p == ilen ? 0 : -1;
    }
    if (enc != ENC_BITMAP || ilen != (elems + 7) / 8) return -1;
    for (size_t byte = 0; byte < ilen; byte++) {
        unsigned b = data[byte];
        while (b) {
            const size_t i = byte * 8 + (size_t)__builtin_ctz(b);
            b &= b - 1;
            if (i >= elems || n >= count) return -1;
            cursor_skip(q, (size_t)((int64_t)i - (last < 0 ? 0 : last)));
            report(q, n++, vals);
            last = (int64_t)i;
        }
    }
    return n == count ? 0 : -1;
}

/* Whether every element of the tile lies in the box with columns one run (col_stride 1): then
 * element i of the tile lands at row_map[row0 + i / w] + (tile c0 - box c0) + i % w. */
static int tile_inside(const int64_t *g, const tile_geo_t *t)
{
    const int64_t *row_map = (const int64_t *)(uintptr_t)g[7];
    if (g[10] != 1 || (int64_t)t->c0 < g[8] || (int64_t)(t->c0 + t->w) > g[9]) return 0;
    for (size_t r = t->row0; r < t->row0 + t->nrows; r++)
        if (row_map[r] < 0) return 0;
    return 1;
}

/* i / w for i < 2^32 without a division (Lemire's fastdiv; w >= 2) */
static inline uint64_t fastdiv(uint64_t i, uint64_t magic) { return (uint64_t)(((__uint128_t)magic * i) >> 64); }

/* one LEB128 gap (the stream was checked in pass A) */
static inline uint64_t leb_next(const unsigned char **pp)
{
    const unsigned char *p = *pp;
    uint64_t g = *p++;
    if (__builtin_expect(g >= 0x80, 0)) {
        g &= 0x7f;
        int shift = 7;
        for (;;) {
            const unsigned char b = *p++;
            g |= (uint64_t)(b & 0x7f) << shift;
            shift += 7;
            if (!(b & 0x80)) break;
        }
    }
    *pp = p;
    return g;
}

/* Pass B of an encoded tile wholly inside its box, into host memory: decode the indices once
 * more and write each value where it lands (the tile's elements in increasing order, so the
 * writes walk the buffer forwards). */
#ifndef APPLY_CHUNK
#define APPLY_CHUNK 256
#endif
#ifndef APPLY_PF
#define APPLY_PF 0
#endif
#define APPLY_INSIDE(T)                                                                               \
    do {                                                                                            \
        T *d = (T *)(void *)dest;                                                                   \
        const T *v = (const T *)(const void *)vals;                                                 \
        if (enc == ENC_VARINT) {                                                                    \
            const unsigned char *p = data;                                                          \
            uint64_t i = (uint64_t)-1;                                                              \
            int64_t at[APPLY_CHUNK];                                                                \
            for (size_t n0 = 0; n0 < count; n0 += APPLY_CHUNK) {                                    \
                const size_t m = count - n0 < APPLY_CHUNK ? count - n0 : APPLY_CHUNK;               \
                for (size_t k = 0; k < m; k++) {                                                    \
                    i += 1 + leb_next(&p);                                                          \
                    const uint64_t r = w == 1 ? i : fastdiv(i, magic);                              \
                    at[k] = rm[r] + cofs + (int64_t)(i - r * w);                                    \
                    if (APPLY_PF && k < APPLY_PF) __builtin_prefetch(d + at[k], 1);                 \
                }                                                                                   \
                for (size_t k = 0; k < m; k++) {                                                    \
                    if (APPLY_PF && k + APPLY_PF < m) __builtin_prefetch(d + at[k + APPLY_PF], 1);  \
                    d[at[k]] = v[n0 + k];                                                           \
                }                                                                                   \
            }                                                                                       \
        } else {                                                                                    \
            size_t n = 0;                                                                           \
            for (size_t byte = 0; byte < ilen; byte++) {                                            \
                unsigned b = data[byte];                                                            \
                while (b) {                                                                         \
                    const uint64_t i = byte * 8 + (uint64_t)__builtin_ctz(b);                       \
                    b &= b - 1;                                                                     \
                    const uint64_t r = w == 1 ? i : fastdiv(i, magic);                              \
                    d[rm[r] + cofs + (int64_t)(i - r * w)] = v[n++];                                \
                }                                                                                   \
            }                                                                                       \
        }                                                                                           \
    } while (0)

static void apply_inside(const int64_t *g, const tile_geo_t *t, uint64_t enc, size_t count, const unsigned char *data,
                         size_t ilen, const unsigned char *vals)
{
    const int64_t *rm = (const int64_t *)(uintptr_t)g[7] + t->row0;
    const int64_t cofs = (int64_t)t->c0 - g[8];
    const uint64_t w = t->w, magic = w > 1 ? UINT64_MAX / w + 1 : 0;
    unsigned char *dest = (unsigned char *)(uintptr_t)g[11];
    switch (g[0]) {
    case 1: APPLY_INSIDE(uint8_t); break;
    case 2: APPLY_INSIDE(uint16_t); break;
    case 4: APPLY_INSIDE(uint32_t); break;
    default: APPLY_INSIDE(uint64_t); break;
    }
}

/* Pass B of an encoded tile that the box cuts (or a strided buffer): the cursor, element by
 * element, writing those inside the box. */
static void apply_cut(const tile_geo_t *t, uint64_t enc, size_t count, const unsigned char *data, size_t ilen,
                      const unsigned char *vals, cursor_t *q)
{
    const size_t esize = q->esize;
    int64_t last = -1;
    if (enc == ENC_VARINT) {
        const unsigned char *p = data;
        for (size_t n = 0; n < count; n++) {
            const uint64_t gap = leb_next(&p);
            cursor_skip(q, (size_t)(last < 0 ? gap : gap + 1));
            last += 1 + (int64_t)gap;
            const int64_t at = cursor_at(q);
            if (at >= 0) elem_copy(q->dest + at * (int64_t)esize, vals + n * esize, esize);
        }
        return;
    }
    size_t n = 0;
    for (size_t byte = 0; byte < ilen; byte++) {
        unsigned b = data[byte];
        while (b) {
            const size_t i = byte * 8 + (size_t)__builtin_ctz(b);
            b &= b - 1;
            cursor_skip(q, (size_t)((int64_t)i - (last < 0 ? 0 : last)));
            last = (int64_t)i;
            const int64_t at = cursor_at(q);
            if (at >= 0) elem_copy(q->dest + at * (int64_t)esize, vals + n * esize, esize);
            n++;
        }
    }
}

/* Pass A of an encoded tile wholly inside its box: the stream holds exactly `count` indices,
 * increasing, below the tile's elements, and nothing after them (the writes need no more). */
#if HAVE_AVX512
/* The varint check of check_inside, 64 bytes at a time, for streams of one- and two-byte gaps (every
 * tile of 16-bit or wider elements: fewer than 2^14 elements): a byte whose predecessor has its
 * continuation bit is a gap's second byte, worth 128 times its low bits. 1: a longer gap (check
 * element by element instead); else 0 or -1 as check_inside. */
__attribute__((target("avx512f,avx512bw"))) static int check_varint_avx512(size_t count, size_t elems,
                                                                          const unsigned char *data, size_t ilen)
{
    /* a last byte with its continuation bit starts a gap the stream lacks (`carry` below sees this
     * only at a 64-byte boundary) */
    if (ilen && (data[ilen - 1] & 0x80)) return -1;
    const __m512i low7 = _mm512_set1_epi8(0x7f), zero = _mm512_setzero_si512();
    __m512i first = zero, second = zero; /* 64-bit lane sums of the gaps' first and second bytes */
    uint64_t carry = 0, n = 0;
    for (size_t p = 0; p < ilen; p += 64) {
        const uint64_t valid = ilen - p >= 64 ? ~0ull : (1ull << (ilen - p)) - 1;
        const __m512i x = _mm512_maskz_loadu_epi8(valid, data + p);
        const uint64_t cont = _mm512_movepi8_mask(x); /* continuation bits */
        const uint64_t after = (cont << 1) | carry;   /* bytes that follow one */
        if (cont & after) return 1;                   /* a gap of three bytes or more */
        carry = cont >> 63;
        n += (uint64_t)__builtin_popcountll(~cont & valid);
        const __m512i v = _mm512_and_si512(x, low7);
        first = _mm512_add_epi64(first, _mm512_sad_epu8(_mm512_maskz_mov_epi8(~after & valid, v), zero));
        second = _mm512_add_epi64(second, _mm512_sad_epu8(_mm512_maskz_mov_epi8(after & valid, v), zero));
    }
    const uint64_t sum = (uint64_t)_mm512_reduce_add_epi64(first) + 128 * (uint64_t)_mm512_reduce_add_epi64(second);
    return !carry && n == count && sum + count <= elems ? 0 : -1;
}
#endif

static int check_inside(uint64_t enc, size_t count, size_t elems, const unsigned char *data, size_t ilen, int simd)
{
    if (enc == ENC_BITMAP) {
        if (ilen != (elems + 7) / 8) return -1;
        size_t n = 0;
        for (size_t byte = 0; byte < ilen; byte++) n += (size_t)__builtin_popcount(data[byte]);
        if (elems % 8 && (data[ilen - 1] >> (elems % 8))) return -1; /* bits past the tile */
        return n == count ? 0 : -1;
    }
    if (enc != ENC_VARINT) return -1;
#if HAVE_AVX512
    if (simd) {
        const int rc = check_varint_avx512(count, elems, data, ilen);
        if (rc <= 0) return rc;
    }
#endif
    /* count the gaps and sum them: the last index is sum + count - 1. Eight one-byte gaps at a
     * time where no byte has its continuation bit (most of a sparse tile's stream). */
    size_t p = 0, n = 0;
    uint64_t sum = 0;
    while (p < ilen) {
        if (p + 8 <= ilen) {
            uint64_t w;
            memcpy(&w, data + p, 8);
            if (!(w & 0x8080808080808080ull)) {
                const uint64_t x = (w & 0x00ff00ff00ff00ffull) + ((w >> 8) & 0x00ff00ff00ff00ffull);
                sum += (x * 0x0001000100010001ull) >> 48;
                n += 8, p += 8;
                continue;
            }
        }
        uint64_t gap = data[p++];
        if (gap & 0x80) { /* at most three bytes: a tile has fewer than 2^21 elements */
            if (p >= ilen) return -1;
            const uint64_t b1 = data[p++];
            gap = (gap & 0x7f) | (b1 & 0x7f) << 7;
            if (b1 & 0x80) {
                if (p >= ilen || data[p] & 0x80) return -1;
                gap |= (uint64_t)data[p++] << 14;
            }
        }
        sum += gap;
        n++;
    }
    return n == count && sum + count <= elems ? 0 : -1;
}

/* tile ti in pass A (check=1: check it, fill the output arrays) or pass B (write host memory);
 * 0 when it is well-formed, -1 otherwise */
static int decode_tile(decode_t *D, size_t ti, size_t *in)
{
    const int64_t *T = D->tiles + TD_COLS * ti;
    if (T[0] < 0 || (size_t)T[0] >= D->ngeoms) return -1;
    const int64_t *g = D->geoms + GE_COLS * T[0];
    tile_geo_t t;
    if (tile_geo(g, T[1], &t) != 0) return -1;
    const size_t esize = (size_t)g[0], elems = t.nrows * t.w;
    const uint64_t word = (uint64_t)T[3], enc = word >> ENC_SHIFT, count = word & COUNT_MASK;
    const unsigned char *data = (const unsigned char *)(uintptr_t)T[2];
    const size_t len = (size_t)T[4];
    const int pass = D->check ? 0 : 1;
    cursor_t q;
    cursor_init(&q, g, &t, (int64_t *)(uintptr_t)T[5], (unsigned char *)(uintptr_t)T[6]);
    int rc = -1;
    if (enc == ENC_NONE) {
        rc = count == 0 && len == 0 ? 0 : -1;
    } else if (enc == ENC_RAW) {
        rc = decode_raw(g, &t, data, len, pass, &q);
    } else if (count == 0 || count > elems || len < count * esize) {
        rc = -1;
    } else {
        const size_t ilen = len - count * esize;
        const unsigned char *vals = data + ilen;
        /* host buffers without output arrays: pass A checks, pass B decodes again and writes */
        const int inside = q.dest != NULL && q.out_off == NULL && tile_inside(g, &t);
        if (pass == 0 && inside) {
            rc = check_inside(enc, count, elems, data, ilen, D->simd);
            q.in += rc == 0 ? count : 0;
        } else if (pass == 0) {
            rc = check_coded(&t, enc, count, data, ilen, vals, &q);
        } else {
            if (inside) apply_inside(g, &t, enc, count, data, ilen, vals);
            else if (q.dest != NULL) apply_cut(&t, enc, count, data, ilen, vals, &q);
            rc = 0;
        }
    }
    *in += q.in;
    return rc;
}

static void *decode_worker(void *arg)
{
    decode_t *D = ((decode_job_t *)arg)->D;
    size_t i, in = 0;
    while ((i = __atomic_fetch_add(&D->next, 1, __ATOMIC_RELAXED)) < D->ntiles) {
        if (decode_tile(D, i, &in) != 0) {
            size_t want = i + 1, cur = __atomic_load_n(&D->bad, __ATOMIC_RELAXED);
            while ((cur == 0 || want < cur) &&
                   !__atomic_compare_exchange_n(&D->bad, &cur, want, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
            }
        }
    }
    __atomic_fetch_add(&D->written, in, __ATOMIC_RELAXED);
    return NULL;
}

static PyObject *mod_decode(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"geoms", "tiles", "threads", "check", "simd", NULL};
    PyObject *g_obj, *t_obj;
    int threads = 1, check = 1, simd = 1; /* simd 0: the scalar check even where AVX-512 runs (tests) */
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|iii", kwlist, &g_obj, &t_obj, &threads, &check, &simd))
        return NULL;
    Py_buffer gb, tb;
    if (get_table(g_obj, &gb, GE_COLS, "geoms", 0) != 0) return NULL;
    if (get_table(t_obj, &tb, TD_COLS, "tiles", 0) != 0) {
        PyBuffer_Release(&gb);
        return NULL;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_JOBS) threads = MAX_JOBS;
    decode_t D = {gb.buf, (size_t)gb.shape[0], tb.buf, (size_t)tb.shape[0], check, 0, 0, 0, simd && has_avx512()};
    decode_job_t jobs[MAX_JOBS];
    for (int t = 0; t < MAX_JOBS; t++) jobs[t].D = &D;
    int nj = D.ntiles > 64 ? threads : 1;
    Py_BEGIN_ALLOW_THREADS
    run_jobs(decode_worker, jobs, sizeof(decode_job_t), nj);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&gb);
    PyBuffer_Release(&tb);
    return Py_BuildValue("(LK)", D.bad ? (long long)D.bad - 1 : -1LL, (unsigned long long)D.written);
}

/* ---------------------------------------------------------------- digest: verification */

/* tiles: geom, tile id; out: XXH3-64 of each whole tile of the geometry's destination memory
 * (element (r, c) at dest + (row_map[r] + (c - c0) * col_stride) * esize; every row of the tile
 * mapped: the caller passes only tiles its box holds whole) */
typedef struct {
    const int64_t *geoms;
    size_t ngeoms;
    const int64_t *tiles;
    size_t ntiles;
    uint64_t *out;
    size_t next;
    int bad;
} digest_t;

typedef struct {
    digest_t *D;
    unsigned char *tmp; /* TILE_BYTES: a tile's rows gathered */
} digest_job_t;

/* tile (r, c) geometry -> its bytes in the destination, gathered into tmp: the tile's rows in
 * order, as the publisher hashed them (delta_format.py: one run of memory, or row by row) */
static const unsigned char *dest_row(const int64_t *g, const int64_t *row_map, size_t r, size_t c0, size_t w,
                                     unsigned char *tmp)
{
    const size_t esize = (size_t)g[0];
    const unsigned char *p = (const unsigned char *)(uintptr_t)g[11] + (row_map[r] + ((int64_t)c0 - g[8]) * g[10]) * (int64_t)esize;
    if (g[10] == 1) return p;
    for (size_t c = 0; c < w; c++) memcpy(tmp + c * esize, p + (int64_t)c * g[10] * (int64_t)esize, esize);
    return tmp;
}

static void *digest_worker(void *arg)
{
    digest_job_t *J = arg;
    digest_t *D = J->D;
    size_t i;
    while ((i = __atomic_fetch_add(&D->next, 1, __ATOMIC_RELAXED)) < D->ntiles) {
        const int64_t *T = D->tiles + 2 * i;
        tile_geo_t t;
        if (T[0] < 0 || (size_t)T[0] >= D->ngeoms) { D->bad = 1; continue; }
        const int64_t *g = D->geoms + GE_COLS * T[0];
        const size_t esize = (size_t)g[0];
        if (tile_geo(g, T[1], &t) != 0 || esize * t.w * t.nrows > TILE_BYTES) { D->bad = 1; continue; }
        const int64_t *row_map = (const int64_t *)(uintptr_t)g[7];
        const size_t seg = t.w * esize;
        for (size_t r = 0; r < t.nrows; r++) { /* the tile's rows in order, as the publisher hashed them */
            unsigned char *to = J->tmp + r * seg;
            const unsigned char *p = dest_row(g, row_map, t.row0 + r, t.c0, t.w, to);
            if (p != to) memcpy(to, p, seg);
        }
        D->out[i] = H.oneshot(J->tmp, t.nrows * seg);
    }
    return NULL;
}

static PyObject *mod_digest(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"geoms", "tiles", "out", "threads", NULL};
    PyObject *g_obj, *t_obj, *o_obj;
    int threads = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|i", kwlist, &g_obj, &t_obj, &o_obj, &threads)) return NULL;
    if (H.oneshot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "digest: the XXH3 functions are not loaded (load_xxh3)");
        return NULL;
    }
    Py_buffer gb, tb, ob;
    if (get_table(g_obj, &gb, GE_COLS, "geoms", 0) != 0) return NULL;
    if (get_table(t_obj, &tb, 2, "tiles", 0) != 0) {
        PyBuffer_Release(&gb);
        return NULL;
    }
    if (PyObject_GetBuffer(o_obj, &ob, PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) != 0 ||
        (size_t)ob.len < (size_t)tb.shape[0] * 8) {
        if (!PyErr_Occurred()) {
            PyBuffer_Release(&ob);
            PyErr_SetString(PyExc_ValueError, "digest: out must hold one uint64 per tile");
        }
        PyBuffer_Release(&gb);
        PyBuffer_Release(&tb);
        return NULL;
    }
    if (threads < 1) threads = 1;
    if (threads > MAX_JOBS) threads = MAX_JOBS;
    digest_t D = {gb.buf, (size_t)gb.shape[0], tb.buf, (size_t)tb.shape[0], ob.buf, 0, 0};
    digest_job_t jobs[MAX_JOBS];
    int nj = D.ntiles > 16 ? threads : 1, nomem = 0;
    for (int t = 0; t < nj; t++) {
        jobs[t].D = &D;
        jobs[t].tmp = malloc(TILE_BYTES);
        if (!jobs[t].tmp) nomem = 1;
    }
    if (!nomem) {
        Py_BEGIN_ALLOW_THREADS
        run_jobs(digest_worker, jobs, sizeof(digest_job_t), nj);
        Py_END_ALLOW_THREADS
    }
    for (int t = 0; t < nj; t++) {
        free(jobs[t].tmp);
    }
    PyBuffer_Release(&gb);
    PyBuffer_Release(&tb);
    PyBuffer_Release(&ob);
    if (nomem) return PyErr_NoMemory();
    if (D.bad) {
        PyErr_SetString(PyExc_ValueError, "digest: a tile outside its geometry");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *mod_hash(PyObject *m, PyObject *arg)
{
    if (H.oneshot == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "hash: the XXH3 functions are not loaded (load_xxh3)");
        return NULL;
    }
    Py_buffer b;
    if (PyObject_GetBuffer(arg, &b, PyBUF_C_CONTIGUOUS) != 0) return NULL;
    uint64_t h = H.oneshot(b.buf, (size_t)b.len);
    PyBuffer_Release(&b);
    return PyLong_FromUnsignedLongLong(h);
}

static PyMethodDef methods[] = {
    {"load_xxh3", mod_load_xxh3, METH_O, "load_xxh3(path) -> bool: take XXH3 from the xxhash extension at path"},
    {"stage", (PyCFunction)(void (*)(void))mod_stage, METH_VARARGS | METH_KEYWORDS,
     "stage(shards, tiles, threads=1, streaming=0, arenas=None, simd=1) -> arenas: compare-and-copy into staging"},
    {"place", mod_place, METH_VARARGS, "place(arenas, rows): copy encoded tiles (loc, len, dst) out of the arenas"},
    {"decode", (PyCFunction)(void (*)(void))mod_decode, METH_VARARGS | METH_KEYWORDS,
     "decode(geoms, tiles, threads=1, check=1, simd=1) -> (first bad tile or -1, elements inside their boxes)"},
    {"digest", (PyCFunction)(void (*)(void))mod_digest, METH_VARARGS | METH_KEYWORDS,
     "digest(geoms, tiles, out, threads=1): XXH3-64 of whole tiles of destination memory"},
    {"hash", mod_hash, METH_O, "hash(buffer) -> int: XXH3-64 of a contiguous buffer"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_delta", "change maps of delta versions", -1, methods};

PyMODINIT_FUNC PyInit__delta(void) { return PyModule_Create(&module); }
