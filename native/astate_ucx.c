/*
 * astate_store._ucx -- a thin CPython binding over libucp for one-sided reads.
 *
 * Only what the data path needs lives here: a context+worker (with an optional
 * background progress thread), endpoints from a remote worker address, memory
 * registration + packed rkeys, rkey unpack, and one batched get that runs a whole
 * plan with a bounded window of outstanding ucp_get_nbx requests, GIL released.
 * Plus cma_read: the same-host fast path, rows as batched process_vm_readv; and copy_rows:
 * rows copied from peer memory mapped into this process (memfd staging); sock_rows: rows sent or
 * received over a stream socket (the tcp path's streamed reads).
 *
 * Objects and lifetimes
 *   Worker      owns ucp_context + ucp_worker + a mutex that serializes every UCX call
 *               (the worker is created UCS_THREAD_MODE_SERIALIZED; our mutex provides
 *               the serialization, including against the progress thread).
 *   Endpoint    holds a strong reference to its Worker.
 *   RemoteKey   holds a strong reference to its Endpoint.
 *   MemHandle   holds a strong reference to its Worker.
 *   Worker.close() tears everything down in the order UCX wants: rkeys of each
 *   endpoint, the endpoint, memory handles, progress thread, worker, context.
 *   Child objects stay valid Python objects afterwards but report closed.
 *
 * Locking rule: the GIL is never acquired while Worker.lock is held, and Worker.lock is
 * never waited for while the GIL is held. Methods release the GIL, take the lock, do
 * pure-C work, unlock, then take the GIL back. tp_dealloc tries the lock first and,
 * when another thread holds it (a batched get may hold it for its whole timeout),
 * releases the GIL while it waits (lock_gil_free), so the interpreter never freezes.
 *
 * Untrusted input: worker addresses and packed rkeys come from other processes
 * (through etcd). UCX parses both without a length, so they are bounded in size,
 * checked for what UCX would abort on or over-read with (check_rkey_blob: the rkey
 * layout; check_worker_address: the address version), and handed to UCX from a copy
 * followed by 64 KiB of zeros, which bounds how far a lying length can lead its
 * parser. UCX's address parser is not validated field by field: a crafted address
 * is only as safe as UCX's own parsing of it.
 */
#define _GNU_SOURCE
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <ucp/api/ucp.h>

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

static PyObject *UcxError; /* module-level exception class */

/* ------------------------------------------------------------------ helpers */

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Raise UcxError(message) with .status (int) and .status_text (str). */
static PyObject *raise_ucx(ucs_status_t status, const char *fmt, ...)
{
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    const char *text = ucs_status_string(status);
    PyObject *s = PyUnicode_FromFormat("%s: %s (UCX status %d)", msg, text, (int)status);
    if (s == NULL) return NULL;
    PyObject *exc = PyObject_CallOneArg(UcxError, s);
    Py_DECREF(s);
    if (exc == NULL) return NULL;
    PyObject *st = PyLong_FromLong((long)status);
    PyObject *tx = PyUnicode_FromString(text);
    if (st && tx) {
        PyObject_SetAttrString(exc, "status", st);
        PyObject_SetAttrString(exc, "status_text", tx);
    }
    Py_XDECREF(st);
    Py_XDECREF(tx);
    PyErr_SetObject(UcxError, exc);
    Py_DECREF(exc);
    return NULL;
}

/* ------------------------------------------------------------------ types */

typedef struct WorkerObject WorkerObject;
typedef struct EndpointObject EndpointObject;
typedef struct RkeyObject RkeyObject;
typedef struct MemObject MemObject;

struct WorkerObject {
    PyObject_HEAD
    ucp_context_h ctx;
    ucp_worker_h worker;
    pthread_mutex_t lock;
    int lock_inited;
    int closed;
    pid_t owner;           /* process that created it (UCX state is not fork-safe) */
    int wakeup;            /* context created with UCP_FEATURE_WAKEUP */
    PyObject *address;     /* bytes */
    /* progress thread */
    int thread_running;
    pthread_t thread;
    int stop_pipe[2];
    volatile int stop;
    int efd;               /* -1: sleep-poll mode */
    long poll_us;          /* idle sleep (sleep mode) / poll timeout cap (efd mode) */
    /* children */
    EndpointObject *eps;
    MemObject *mems;
};

struct EndpointObject {
    PyObject_HEAD
    WorkerObject *w;
    ucp_ep_h ep;
    volatile ucs_status_t failed; /* set by the error handler */
    int peer_mode;
    EndpointObject *prev, *next;
    RkeyObject *rkeys;
};

struct RkeyObject {
    PyObject_HEAD
    EndpointObject *e;
    ucp_rkey_h rkey;
    RkeyObject *prev, *next;
};

struct MemObject {
    PyObject_HEAD
    WorkerObject *w;
    ucp_mem_h memh;
    uint64_t address;
    uint64_t length;
    int memory_type;
    PyObject *packed; /* cached rkey bytes */
    MemObject *prev, *next;
};

static PyTypeObject WorkerType, EndpointType, RkeyType, MemType;

#define LIST_PUSH(head, obj)                                                   \
    do {                                                                       \
        (obj)->prev = NULL;                                                    \
        (obj)->next = (head);                                                  \
        if (head) (head)->prev = (obj);                                        \
        (head) = (obj);                                                        \
    } while (0)
#define LIST_UNLINK(head, obj)                                                 \
    do {                                                                       \
        if ((obj)->prev) (obj)->prev->next = (obj)->next;                      \
        else if ((head) == (obj)) (head) = (obj)->next;                        \
        if ((obj)->next) (obj)->next->prev = (obj)->prev;                      \
        (obj)->prev = (obj)->next = NULL;                                      \
    } while (0)

static void wunlock(WorkerObject *w) { pthread_mutex_unlock(&w->lock); }

/* Take w->lock from a context that holds the GIL (tp_dealloc): never wait for the lock
 * with the GIL held, since a get may hold the lock for up to its timeout. */
static void lock_gil_free(WorkerObject *w)
{
    if (pthread_mutex_trylock(&w->lock) == 0) return;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    Py_END_ALLOW_THREADS
}

/* Bounds on blobs from other processes. */
#define MAX_WORKER_ADDRESS (64 * 1024)
#define MAX_RKEY_BLOB 4096
/* Zero bytes after a copied blob: UCX's parsers take no length and may read past a lying
 * one (an address entry's lengths are bytes, so a run of zeros ends the parse quickly). */
#define BLOB_PAD (64 * 1024)

/* Heap copy of blob with BLOB_PAD zero bytes after it (PyMem_RawFree it). */
static void *padded_copy(const void *buf, size_t len)
{
    unsigned char *p = PyMem_RawCalloc(len + BLOB_PAD, 1);
    if (p != NULL) memcpy(p, buf, len);
    return p;
}

/* What UCX would abort on rather than refuse, in a worker address: its header's version
 * (ucp_address_unpack_header asserts v1 or v2). NULL if plausible. */
static const char *check_worker_address(const unsigned char *p, size_t len)
{
    if (len < 2) return "shorter than a header";
    unsigned maj = 0, min = 0, rel = 0;
    ucp_get_version(&maj, &min, &rel);
    if (maj == 1 && (p[0] & 0x0f) > 1) return "unknown address version";
    return NULL;
}

/* Check a packed rkey against UCX 1.x's layout before ucp_ep_rkey_unpack parses it
 * (it takes no length): md_map (u64), memory type (u8), then per set md_map bit one
 * size byte and that many bytes; newer versions append optional fields after them.
 * Returns NULL if plausible, else what is wrong. */
static const char *check_rkey_blob(const unsigned char *p, size_t len)
{
    if (len == 0) return "empty rkey";
    if (len > MAX_RKEY_BLOB) return "rkey longer than 4096 bytes";
    unsigned maj = 0, min = 0, rel = 0;
    ucp_get_version(&maj, &min, &rel);
    if (maj != 1) return NULL; /* unknown layout: bounds and padding only */
    if (len < 9) return "rkey shorter than its header (9 bytes)";
    uint64_t md_map;
    memcpy(&md_map, p, sizeof(md_map));
    if (p[8] >= UCS_MEMORY_TYPE_LAST) return "rkey names an unknown memory type";
    size_t off = 9;
    for (int bit = 0; bit < 64; bit++) {
        if (!(md_map & (1ull << bit))) continue;
        if (off >= len) return "rkey truncated (md entries past its end)";
        off += 1 + (size_t)p[off];
        if (off > len) return "rkey truncated (md entry past its end)";
    }
    return NULL;
}

/* ------------------------------------------------------------------ teardown (lock held) */

static void rkey_destroy_locked(RkeyObject *r)
{
    if (r->rkey) {
        ucp_rkey_destroy(r->rkey);
        r->rkey = NULL;
        LIST_UNLINK(r->e->rkeys, r);
    }
}

/* Wait (progressing) for a request; frees it. Returns its status or UCS_ERR_TIMED_OUT. */
static ucs_status_t wait_req_locked(WorkerObject *w, void *req, double timeout)
{
    if (req == NULL) return UCS_OK;
    if (UCS_PTR_IS_ERR(req)) return UCS_PTR_STATUS(req);
    double deadline = timeout >= 0 ? now_s() + timeout : -1.0;
    ucs_status_t st;
    unsigned it = 0;
    while ((st = ucp_request_check_status(req)) == UCS_INPROGRESS) {
        ucp_worker_progress(w->worker);
        if (deadline >= 0 && (++it & 63) == 0 && now_s() > deadline) {
            st = UCS_ERR_TIMED_OUT;
            break;
        }
    }
    ucp_request_free(req); /* released by UCX on completion if still in flight */
    return st;
}

/* Close an endpoint: its rkeys first. force: no flush (requires PEER mode). */
static ucs_status_t ep_close_locked(EndpointObject *e, int force, double timeout)
{
    WorkerObject *w = e->w;
    while (e->rkeys) rkey_destroy_locked(e->rkeys);
    if (e->ep == NULL) return UCS_OK;
    ucp_request_param_t p;
    memset(&p, 0, sizeof(p));
    p.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    p.flags = force ? UCP_EP_CLOSE_FLAG_FORCE : 0;
    void *req = ucp_ep_close_nbx(e->ep, &p);
    e->ep = NULL;
    LIST_UNLINK(w->eps, e);
    return wait_req_locked(w, req, timeout);
}

static int ep_default_force(EndpointObject *e)
{
    /* A failed endpoint is force-closed (a flush would only report the failure again;
     * the remote side is gone, so the PEER-mode requirement of FORCE does not apply). */
    return e->failed != UCS_OK;
}

static void mem_unmap_locked(MemObject *m)
{
    if (m->memh) {
        ucp_mem_unmap(m->w->ctx, m->memh);
        m->memh = NULL;
        LIST_UNLINK(m->w->mems, m);
    }
}

/* ------------------------------------------------------------------ progress thread */

static void *progress_main(void *arg)
{
    WorkerObject *w = (WorkerObject *)arg;
    /* never take signals meant for the Python main thread */
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL);
    struct pollfd fds[2];
    fds[0].fd = w->stop_pipe[0];
    fds[0].events = POLLIN;
    fds[1].fd = w->efd;
    fds[1].events = POLLIN;
    /* In efd mode the timeout is only a safety net: events that arrive after
     * ucp_worker_arm() leave the fd readable until the next arm. */
    const int poll_ms = 100;

    while (!w->stop) {
        ucs_status_t st = UCS_ERR_BUSY;
        unsigned total = 0, n, rounds = 0;
        pthread_mutex_lock(&w->lock);
        do {
            n = ucp_worker_progress(w->worker);
            total += n;
        } while (n != 0 && ++rounds < 64 && !w->stop);
        if (n == 0 && w->efd >= 0) st = ucp_worker_arm(w->worker);
        pthread_mutex_unlock(&w->lock);
        if (w->stop) break;
        if (st == UCS_OK) {
            poll(fds, 2, poll_ms);
        } else if (st == UCS_ERR_BUSY) {
            if (total == 0) {
                if (w->efd >= 0) {
                    sched_yield();
                } else {
                    struct timespec ts = {w->poll_us / 1000000, (w->poll_us % 1000000) * 1000};
                    ppoll(fds, 1, &ts, NULL);
                }
            } else {
                sched_yield(); /* let the owner thread take the lock */
            }
        } else {
            w->efd = -1; /* arm failed: fall back to sleep-poll */
        }
    }
    return NULL;
}

/* Workers whose progress thread runs. At exit() (after Python finalization, before
 * UCX's library destructors) any thread still running is stopped, so it never
 * progresses a worker while UCX tears itself down. */
#define MAX_THREADS 256
static pthread_mutex_t g_threads_lock = PTHREAD_MUTEX_INITIALIZER;
static WorkerObject *g_threads[MAX_THREADS];

static void threads_add(WorkerObject *w)
{
    pthread_mutex_lock(&g_threads_lock);
    for (int i = 0; i < MAX_THREADS; i++)
        if (g_threads[i] == NULL) {
            g_threads[i] = w;
            break;
        }
    pthread_mutex_unlock(&g_threads_lock);
}

static void threads_remove(WorkerObject *w)
{
    pthread_mutex_lock(&g_threads_lock);
    for (int i = 0; i < MAX_THREADS; i++)
        if (g_threads[i] == w) g_threads[i] = NULL;
    pthread_mutex_unlock(&g_threads_lock);
}

static void signal_stop(WorkerObject *w)
{
    w->stop = 1;
    char c = 'x';
    ssize_t rc = write(w->stop_pipe[1], &c, 1);
    (void)rc;
}

static void stop_thread_nogil(WorkerObject *w)
{
    if (!w->thread_running) return;
    threads_remove(w);
    signal_stop(w);
    pthread_join(w->thread, NULL);
    w->thread_running = 0;
}

static void forget_threads_in_child(void)
{
    /* after fork(): the parent's progress threads do not exist here */
    memset(g_threads, 0, sizeof(g_threads));
}

static void stop_all_threads_at_exit(void)
{
    pthread_mutex_lock(&g_threads_lock);
    for (int i = 0; i < MAX_THREADS; i++) {
        WorkerObject *w = g_threads[i];
        if (w == NULL) continue;
        g_threads[i] = NULL;
        signal_stop(w);
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_sec += 1;
        if (pthread_timedjoin_np(w->thread, NULL, &ts) == 0) w->thread_running = 0;
    }
    pthread_mutex_unlock(&g_threads_lock);
}

static void close_pipes(WorkerObject *w)
{
    if (w->stop_pipe[0] >= 0) close(w->stop_pipe[0]);
    if (w->stop_pipe[1] >= 0) close(w->stop_pipe[1]);
    w->stop_pipe[0] = w->stop_pipe[1] = -1;
}

/* Full teardown, pure C (no Python calls): call without the GIL (check_open and w_live
 * call it with the GIL only in a fork()ed child, where it returns before any lock). */
static void worker_teardown_c(WorkerObject *w)
{
    if (w->owner != getpid()) {
        /* a fork()ed copy: the UCX state and thread belong to the parent; leak them */
        w->closed = 1;
        w->thread_running = 0;
        w->worker = NULL;
        w->ctx = NULL;
        w->eps = NULL;
        w->mems = NULL;
        return;
    }
    pthread_mutex_lock(&w->lock);
    if (w->closed) {
        pthread_mutex_unlock(&w->lock);
        return;
    }
    while (w->eps) ep_close_locked(w->eps, ep_default_force(w->eps), 1.0);
    while (w->mems) mem_unmap_locked(w->mems);
    w->closed = 1; /* the thread keeps progressing harmlessly until stopped */
    pthread_mutex_unlock(&w->lock);
    stop_thread_nogil(w);
    pthread_mutex_lock(&w->lock);
    if (w->worker) ucp_worker_destroy(w->worker);
    w->worker = NULL;
    if (w->ctx) ucp_cleanup(w->ctx);
    w->ctx = NULL;
    pthread_mutex_unlock(&w->lock);
    close_pipes(w);
}

static void worker_teardown(WorkerObject *w, int release_gil)
{
    if (w->closed) return;
    if (release_gil) {
        Py_BEGIN_ALLOW_THREADS
        worker_teardown_c(w);
        Py_END_ALLOW_THREADS
    } else {
        worker_teardown_c(w);
    }
}

/* ------------------------------------------------------------------ Worker */

static int Worker_init(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"config", "progress_thread", "wakeup", "poll_us", NULL};
    PyObject *config = Py_None;
    int progress_thread = 0, wakeup = 1;
    long poll_us = 200;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Oppl", kwlist, &config, &progress_thread,
                                     &wakeup, &poll_us))
        return -1;
    if (self->ctx != NULL || self->closed) {
        PyErr_SetString(PyExc_RuntimeError, "Worker already initialized");
        return -1;
    }
    if (config != Py_None && !PyDict_Check(config)) {
        PyErr_SetString(PyExc_TypeError, "config must be a dict of str -> str");
        return -1;
    }
    if (poll_us < 1) poll_us = 1;
    self->poll_us = poll_us;
    self->stop_pipe[0] = self->stop_pipe[1] = -1;
    self->efd = -1;

    ucp_config_t *cfg = NULL;
    ucs_status_t st = ucp_config_read(NULL, NULL, &cfg);
    if (st != UCS_OK) {
        raise_ucx(st, "ucp_config_read failed");
        return -1;
    }
    if (config != Py_None) {
        PyObject *k, *v;
        Py_ssize_t pos = 0;
        while (PyDict_Next(config, &pos, &k, &v)) {
            if (!PyUnicode_Check(k) || !PyUnicode_Check(v)) {
                ucp_config_release(cfg);
                PyErr_SetString(PyExc_TypeError, "config must be a dict of str -> str");
                return -1;
            }
            const char *ks = PyUnicode_AsUTF8(k), *vs = PyUnicode_AsUTF8(v);
            if (!ks || !vs) {
                ucp_config_release(cfg);
                return -1;
            }
            if (strncmp(ks, "UCX_", 4) == 0) ks += 4;
            st = ucp_config_modify(cfg, ks, vs);
            if (st != UCS_OK) {
                ucp_config_release(cfg);
                raise_ucx(st, "ucp_config_modify(%s=%s) failed", ks, vs);
                return -1;
            }
        }
    }

    ucp_params_t params;
    memset(&params, 0, sizeof(params));
    params.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED |
                        UCP_PARAM_FIELD_NAME;
    params.features = UCP_FEATURE_RMA | (wakeup ? UCP_FEATURE_WAKEUP : 0);
    params.mt_workers_shared = 0;
    params.name = "astate";
    ucp_context_h ctx = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_init(&params, cfg, &ctx);
    Py_END_ALLOW_THREADS
    ucp_config_release(cfg);
    if (st != UCS_OK) {
        raise_ucx(st, "ucp_init failed");
        return -1;
    }
    ucp_worker_params_t wp;
    memset(&wp, 0, sizeof(wp));
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_SERIALIZED;
    ucp_worker_h worker = NULL;
    Py_BEGIN_ALLOW_THREADS
    st = ucp_worker_create(ctx, &wp, &worker);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        ucp_cleanup(ctx);
        raise_ucx(st, "ucp_worker_create failed");
        return -1;
    }
    ucp_address_t *addr = NULL;
    size_t alen = 0;
    st = ucp_worker_get_address(worker, &addr, &alen);
    if (st != UCS_OK) {
        ucp_worker_destroy(worker);
        ucp_cleanup(ctx);
        raise_ucx(st, "ucp_worker_get_address failed");
        return -1;
    }
    self->address = PyBytes_FromStringAndSize((const char *)addr, (Py_ssize_t)alen);
    ucp_worker_release_address(worker, addr);
    if (self->address == NULL) {
        ucp_worker_destroy(worker);
        ucp_cleanup(ctx);
        return -1;
    }
    if (pthread_mutex_init(&self->lock, NULL) != 0) {
        ucp_worker_destroy(worker);
        ucp_cleanup(ctx);
        PyErr_SetString(PyExc_OSError, "pthread_mutex_init failed");
        return -1;
    }
    self->lock_inited = 1;
    self->ctx = ctx;
    self->worker = worker;
    self->owner = getpid();
    self->wakeup = wakeup;

    if (progress_thread) {
        if (wakeup) {
            int fd = -1;
            if (ucp_worker_get_efd(worker, &fd) == UCS_OK) self->efd = fd;
        }
        if (pipe2(self->stop_pipe, O_CLOEXEC | O_NONBLOCK) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            worker_teardown(self, 1);
            return -1;
        }
        self->stop = 0;
        int rc = pthread_create(&self->thread, NULL, progress_main, self);
        if (rc != 0) {
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            worker_teardown(self, 1);
            return -1;
        }
        self->thread_running = 1;
        threads_add(self);
    }
    return 0;
}

static void Worker_dealloc(WorkerObject *self)
{
    if (self->lock_inited) {
        worker_teardown(self, 1); /* never wait for the lock (or the progress thread) with the GIL */
        pthread_mutex_destroy(&self->lock);
        self->lock_inited = 0;
    }
    Py_CLEAR(self->address);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(WorkerObject *w)
{
    if (w->owner != getpid() && !w->closed) {
        worker_teardown_c(w);
        PyErr_SetString(UcxError, "worker was created in another process (fork); it is unusable here");
        return -1;
    }
    if (w->closed || w->worker == NULL) {
        PyErr_SetString(UcxError, "worker is closed");
        return -1;
    }
    return 0;
}

/* Whether w's UCX state may be touched from this process (not a fork()ed copy). */
static int w_live(WorkerObject *w)
{
    if (w == NULL) return 0;
    if (w->owner != getpid()) {
        worker_teardown_c(w); /* marks closed, touches nothing */
        return 0;
    }
    return 1;
}

static PyObject *Worker_close(WorkerObject *self, PyObject *noargs)
{
    if (self->lock_inited) worker_teardown(self, 1);
    Py_RETURN_NONE;
}

static PyObject *Worker_get_address(WorkerObject *self, void *c)
{
    if (self->address == NULL) Py_RETURN_NONE;
    Py_INCREF(self->address);
    return self->address;
}

static PyObject *Worker_get_closed(WorkerObject *self, void *c)
{
    return PyBool_FromLong(self->closed || self->worker == NULL);
}

static PyObject *Worker_get_thread(WorkerObject *self, void *c)
{
    return PyBool_FromLong(self->thread_running);
}

static PyObject *Worker_get_efd_mode(WorkerObject *self, void *c)
{
    return PyBool_FromLong(self->thread_running && self->efd >= 0);
}

/* capture a FILE* printer into a malloc'd C string (no Python calls) */
static char *capture_print(void (*fn)(void *, FILE *), void *arg, size_t *len)
{
    char *buf = NULL;
    *len = 0;
    FILE *f = open_memstream(&buf, len);
    if (f == NULL) return NULL;
    fn(arg, f);
    fclose(f);
    return buf;
}

static void print_ctx(void *a, FILE *f) { ucp_context_print_info((ucp_context_h)a, f); }
static void print_worker(void *a, FILE *f) { ucp_worker_print_info((ucp_worker_h)a, f); }
static void print_ep(void *a, FILE *f) { ucp_ep_print_info((ucp_ep_h)a, f); }

static PyObject *Worker_info(WorkerObject *self, PyObject *noargs)
{
    if (check_open(self)) return NULL;
    char *a = NULL, *b = NULL;
    size_t la = 0, lb = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (!self->closed) {
        a = capture_print(print_ctx, self->ctx, &la);
        b = capture_print(print_worker, self->worker, &lb);
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    PyObject *r = PyUnicode_FromFormat("%s%s", a ? a : "", b ? b : "");
    free(a);
    free(b);
    return r;
}

static void ep_err_cb(void *arg, ucp_ep_h ep, ucs_status_t status)
{
    EndpointObject *e = (EndpointObject *)arg;
    if (e->failed == UCS_OK) e->failed = status;
}

static PyObject *Worker_connect(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"address", "peer_error_handling", NULL};
    Py_buffer addr;
    int peer = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|p", kwlist, &addr, &peer)) return NULL;
    if (check_open(self)) {
        PyBuffer_Release(&addr);
        return NULL;
    }
    if (addr.len < 1 || addr.len > MAX_WORKER_ADDRESS) {
        Py_ssize_t alen = addr.len;
        PyBuffer_Release(&addr);
        return raise_ucx(UCS_ERR_INVALID_PARAM, "worker address of %zd bytes (1..%d allowed)", alen,
                         MAX_WORKER_ADDRESS);
    }
    const char *bad = check_worker_address((const unsigned char *)addr.buf, (size_t)addr.len);
    if (bad != NULL) {
        PyBuffer_Release(&addr);
        return raise_ucx(UCS_ERR_INVALID_PARAM, "refusing a worker address: %s", bad);
    }
    /* UCX parses the address without its length: give it a zero-padded copy */
    void *abuf = padded_copy(addr.buf, (size_t)addr.len);
    PyBuffer_Release(&addr);
    if (abuf == NULL) return PyErr_NoMemory();
    EndpointObject *e = PyObject_New(EndpointObject, &EndpointType);
    if (e == NULL) {
        PyMem_RawFree(abuf);
        return NULL;
    }
    Py_INCREF(self);
    e->w = self;
    e->ep = NULL;
    e->failed = UCS_OK;
    e->peer_mode = peer;
    e->prev = e->next = NULL;
    e->rkeys = NULL;

    ucp_ep_params_t ep_params;
    memset(&ep_params, 0, sizeof(ep_params));
    ep_params.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                           UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep_params.address = (const ucp_address_t *)abuf;
    ep_params.err_mode = peer ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
    ep_params.err_handler.cb = ep_err_cb;
    ep_params.err_handler.arg = e;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (self->closed) {
        st = UCS_ERR_NOT_CONNECTED;
    } else {
        ucp_ep_h ep = NULL;
        st = ucp_ep_create(self->worker, &ep_params, &ep);
        if (st == UCS_OK) {
            e->ep = ep;
            LIST_PUSH(self->eps, e);
        }
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(abuf);
    if (st != UCS_OK) {
        Py_DECREF(e);
        return raise_ucx(st, "ucp_ep_create (%s error handling) failed", peer ? "peer" : "none");
    }
    return (PyObject *)e;
}

static PyObject *Worker_mem_map(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"address", "length", "memory_type", NULL};
    unsigned long long address, length;
    int mtype = UCS_MEMORY_TYPE_UNKNOWN;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "KK|i", kwlist, &address, &length, &mtype))
        return NULL;
    if (address == 0 || length == 0) {
        PyErr_SetString(PyExc_ValueError, "mem_map needs a non-null address and a non-zero length");
        return NULL;
    }
    if (mtype < 0 || mtype > UCS_MEMORY_TYPE_UNKNOWN) {
        PyErr_SetString(PyExc_ValueError, "bad memory_type");
        return NULL;
    }
    if (check_open(self)) return NULL;
    MemObject *m = PyObject_New(MemObject, &MemType);
    if (m == NULL) return NULL;
    Py_INCREF(self);
    m->w = self;
    m->memh = NULL;
    m->address = address;
    m->length = length;
    m->memory_type = mtype;
    m->packed = NULL;
    m->prev = m->next = NULL;

    ucp_mem_map_params_t mp;
    memset(&mp, 0, sizeof(mp));
    mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                    UCP_MEM_MAP_PARAM_FIELD_FLAGS;
    mp.address = (void *)(uintptr_t)address;
    mp.length = (size_t)length;
    mp.flags = 0;
    if (mtype != UCS_MEMORY_TYPE_UNKNOWN) {
        mp.field_mask |= UCP_MEM_MAP_PARAM_FIELD_MEMORY_TYPE;
        mp.memory_type = (ucs_memory_type_t)mtype;
    }
    ucs_status_t st;
    void *rbuf = NULL;
    size_t rlen = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    if (self->closed) {
        st = UCS_ERR_NOT_CONNECTED;
    } else {
        ucp_mem_h memh = NULL;
        st = ucp_mem_map(self->ctx, &mp, &memh);
        if (st == UCS_OK) {
            st = ucp_rkey_pack(self->ctx, memh, &rbuf, &rlen);
            if (st != UCS_OK) {
                ucp_mem_unmap(self->ctx, memh);
            } else {
                m->memh = memh;
                LIST_PUSH(self->mems, m);
            }
        }
    }
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) {
        Py_DECREF(m);
        return raise_ucx(st, "ucp_mem_map(0x%llx, %llu) failed", address, length);
    }
    m->packed = PyBytes_FromStringAndSize((const char *)rbuf, (Py_ssize_t)rlen);
    ucp_rkey_buffer_release(rbuf);
    if (m->packed == NULL) {
        Py_DECREF(m);
        return NULL;
    }
    return (PyObject *)m;
}

/* ---------------------------------------------------------------- batched get */

typedef struct get_slot {
    struct get_batch *b;
    void *req;
    int64_t row;
    int32_t next_free;
    int32_t ep_idx;
    int done;
} get_slot_t;

typedef struct get_batch {
    get_slot_t *slots;
    int32_t free_head;
    size_t outstanding;
    ucs_status_t first_err;
    int64_t err_row;
} get_batch_t;

static void get_cb(void *request, ucs_status_t status, void *user_data)
{
    get_slot_t *s = (get_slot_t *)user_data;
    get_batch_t *b = s->b;
    if (status != UCS_OK && b->first_err == UCS_OK) {
        b->first_err = status;
        b->err_row = s->row;
    }
    ucp_request_free(request);
    s->req = NULL;
    s->done = 1;
    s->next_free = b->free_head;
    b->free_head = (int32_t)(s - b->slots);
    b->outstanding--;
}

/* Snapshot a sequence argument as a tuple (immune to concurrent mutation while the
 * GIL is released) of objects of one type. */
static PyObject *fast_list(PyObject *o, PyTypeObject *tp, const char *what)
{
    PyObject *f = PySequence_Tuple(o);
    if (f == NULL) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(f);
    PyObject **items = PySequence_Fast_ITEMS(f);
    for (Py_ssize_t i = 0; i < n; i++) {
        if (Py_TYPE(items[i]) != tp) {
            PyErr_Format(PyExc_TypeError, "%s[%zd] is %s, expected %s", what, i,
                         Py_TYPE(items[i])->tp_name, tp->tp_name);
            Py_DECREF(f);
            return NULL;
        }
    }
    return f;
}

static PyObject *Worker_get(WorkerObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"plan", "endpoints", "rkeys", "memhs", "timeout", "window", NULL};
    PyObject *plan_obj, *eps_obj, *rks_obj, *mhs_obj = Py_None;
    double timeout = -1.0;
    Py_ssize_t window = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OOO|Odn", kwlist, &plan_obj, &eps_obj, &rks_obj,
                                     &mhs_obj, &timeout, &window))
        return NULL;
    if (window < 1) window = 1;
    if (window > (1 << 20)) window = 1 << 20;
    if (check_open(self)) return NULL;

    Py_buffer pb;
    if (PyObject_GetBuffer(plan_obj, &pb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) != 0)
        return NULL;
    PyObject *eps_f = NULL, *rks_f = NULL, *mhs_f = NULL, *result = NULL;
    ucp_ep_h *c_eps = NULL;
    ucp_rkey_h *c_rks = NULL;
    ucp_mem_h *c_mhs = NULL;
    get_batch_t *batch = NULL;
    unsigned char *used = NULL;
    int leak_batch = 0;

    const char *fmt = pb.format ? pb.format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (pb.itemsize != 8 || strchr("qQlL", fmt[0]) == NULL || fmt[1] != 0 || pb.ndim != 2 ||
        (pb.shape[1] != 5 && pb.shape[1] != 6)) {
        PyErr_SetString(PyExc_ValueError,
                        "plan must be a C-contiguous 2-D array of 64-bit integers with 5 or 6 columns "
                        "(ep, rkey, remote_addr, local_addr, length[, memh])");
        goto out;
    }
    const uint64_t *rows = (const uint64_t *)pb.buf;
    const size_t n = (size_t)pb.shape[0];
    const size_t ncol = (size_t)pb.shape[1];

    if (!(eps_f = fast_list(eps_obj, &EndpointType, "endpoints"))) goto out;
    if (!(rks_f = fast_list(rks_obj, &RkeyType, "rkeys"))) goto out;
    if (mhs_obj != Py_None && !(mhs_f = fast_list(mhs_obj, &MemType, "memhs"))) goto out;
    const size_t neps = (size_t)PySequence_Fast_GET_SIZE(eps_f);
    const size_t nrks = (size_t)PySequence_Fast_GET_SIZE(rks_f);
    const size_t nmhs = mhs_f ? (size_t)PySequence_Fast_GET_SIZE(mhs_f) : 0;
    EndpointObject **E = (EndpointObject **)PySequence_Fast_ITEMS(eps_f);
    RkeyObject **R = (RkeyObject **)PySequence_Fast_ITEMS(rks_f);
    MemObject **M = mhs_f ? (MemObject **)PySequence_Fast_ITEMS(mhs_f) : NULL;

    /* validate indices before any byte moves */
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = rows + i * ncol;
        if (r[0] >= neps || r[1] >= nrks) {
            PyErr_Format(PyExc_IndexError, "plan row %zu: endpoint %llu / rkey %llu out of range (%zu, %zu)",
                         i, (unsigned long long)r[0], (unsigned long long)r[1], neps, nrks);
            goto out;
        }
        if (R[r[1]]->e != E[r[0]]) {
            PyErr_Format(PyExc_ValueError, "plan row %zu: rkey %llu was not unpacked on endpoint %llu", i,
                         (unsigned long long)r[1], (unsigned long long)r[0]);
            goto out;
        }
        if (ncol == 6 && r[5] != UINT64_MAX && r[5] >= nmhs) {
            PyErr_Format(PyExc_IndexError, "plan row %zu: memh %llu out of range (%zu)", i,
                         (unsigned long long)r[5], nmhs);
            goto out;
        }
        if (r[2] == 0 || r[3] == 0) {
            if (r[4] != 0) {
                PyErr_Format(PyExc_ValueError, "plan row %zu: null address", i);
                goto out;
            }
        }
    }
    for (size_t i = 0; i < neps; i++)
        if (E[i]->w != self) {
            PyErr_Format(PyExc_ValueError, "endpoints[%zu] belongs to another worker", i);
            goto out;
        }
    for (size_t i = 0; i < nmhs; i++)
        if (M[i]->w != self) {
            PyErr_Format(PyExc_ValueError, "memhs[%zu] belongs to another worker", i);
            goto out;
        }

    c_eps = PyMem_RawCalloc(neps ? neps : 1, sizeof(*c_eps));
    c_rks = PyMem_RawCalloc(nrks ? nrks : 1, sizeof(*c_rks));
    c_mhs = PyMem_RawCalloc(nmhs ? nmhs : 1, sizeof(*c_mhs));
    used = PyMem_RawCalloc(neps + nrks + nmhs + 1, 1);
    batch = PyMem_RawCalloc(1, sizeof(*batch));
    if (!c_eps || !c_rks || !c_mhs || !used || !batch) {
        PyErr_NoMemory();
        goto out;
    }
    /* only objects some row uses must be alive (others may be closed concurrently) */
    for (size_t i = 0; i < n; i++) {
        const uint64_t *r = rows + i * ncol;
        if (r[4] == 0) continue;
        used[r[0]] = 1;
        used[neps + r[1]] = 1;
        if (ncol == 6 && r[5] != UINT64_MAX) used[neps + nrks + r[5]] = 1;
    }
    batch->slots = PyMem_RawCalloc((size_t)window, sizeof(get_slot_t));
    if (!batch->slots) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t i = 0; i < window; i++) {
        batch->slots[i].b = batch;
        batch->slots[i].next_free = (i + 1 < window) ? (int32_t)(i + 1) : -1;
    }
    batch->free_head = 0;
    batch->first_err = UCS_OK;
    batch->err_row = -1;

    /* run */
    ucs_status_t st = UCS_OK;
    int timed_out = 0, closed_mid = 0;
    int64_t bad_obj = -1; /* which endpoint index was closed/failed before start */
    size_t posted = 0, remaining_after = 0;
    double elapsed = 0;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->lock);
    double t0 = now_s();
    double deadline = timeout >= 0 ? t0 + timeout : -1.0;
    if (self->closed) {
        closed_mid = 1;
    } else {
        for (size_t i = 0; i < neps && bad_obj < 0; i++) {
            c_eps[i] = E[i]->ep;
            if (c_eps[i] == NULL && used[i]) bad_obj = (int64_t)i;
        }
        for (size_t i = 0; i < nrks && bad_obj < 0; i++) {
            c_rks[i] = R[i]->rkey;
            if (c_rks[i] == NULL && used[neps + i]) bad_obj = (int64_t)(neps + i);
        }
        for (size_t i = 0; i < nmhs && bad_obj < 0; i++) {
            c_mhs[i] = M[i]->memh;
            if (c_mhs[i] == NULL && used[neps + nrks + i]) bad_obj = (int64_t)(neps + nrks + i);
        }
    }
    if (!closed_mid && bad_obj < 0) {
        ucp_request_param_t p;
        memset(&p, 0, sizeof(p));
        size_t next = 0;
        unsigned it = 0;
        for (;;) {
            while (next < n && batch->free_head >= 0 && batch->first_err == UCS_OK) {
                const uint64_t *r = rows + next * ncol;
                if (r[4] == 0) {
                    next++;
                    continue;
                }
                EndpointObject *eo = E[r[0]];
                if (eo->failed != UCS_OK) {
                    batch->first_err = eo->failed;
                    batch->err_row = (int64_t)next;
                    break;
                }
                /* take a slot first, so a callback can never see it on the free list */
                const int32_t si = batch->free_head;
                get_slot_t *s = &batch->slots[si];
                batch->free_head = s->next_free;
                s->next_free = -1;
                s->req = NULL;
                s->done = 0;
                s->row = (int64_t)next;
                s->ep_idx = (int32_t)r[0];
                batch->outstanding++;
                p.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
                p.cb.send = get_cb;
                p.user_data = s;
                if (ncol == 6 && r[5] != UINT64_MAX) {
                    p.op_attr_mask |= UCP_OP_ATTR_FIELD_MEMH;
                    p.memh = c_mhs[r[5]];
                }
                ucs_status_ptr_t sp = ucp_get_nbx(c_eps[r[0]], (void *)(uintptr_t)r[3], (size_t)r[4],
                                                  r[2], c_rks[r[1]], &p);
                posted++;
                next++;
                if (s->done) continue; /* callback already ran and returned the slot */
                if (sp == NULL || UCS_PTR_IS_ERR(sp)) { /* completed now: return the slot */
                    s->next_free = batch->free_head;
                    batch->free_head = si;
                    batch->outstanding--;
                    if (sp != NULL) {
                        batch->first_err = UCS_PTR_STATUS(sp);
                        batch->err_row = s->row;
                        break;
                    }
                    continue;
                }
                s->req = sp;
            }
            if (batch->outstanding == 0 && (next >= n || batch->first_err != UCS_OK)) break;
            ucp_worker_progress(self->worker);
            if (deadline >= 0 && (++it & 15) == 0 && now_s() > deadline) {
                timed_out = 1;
                break;
            }
        }
        if (timed_out) {
            /* No request may outlive this call: a late completion would write into memory
             * the caller owns again (and may already have filled from another source).
             * Cancel every outstanding request; force-close the PEER-mode endpoints that
             * still hold some (UCX then completes them with UCS_ERR_CANCELED); wait for
             * every completion callback. RMA requests are rarely cancellable, so the
             * force close is what normally ends them. NONE-mode (shared-memory)
             * endpoints cannot be force-closed; their reads do not depend on the peer's
             * progress and complete locally. */
            for (Py_ssize_t i = 0; i < window; i++)
                if (batch->slots[i].req) ucp_request_cancel(self->worker, batch->slots[i].req);
            double d2 = now_s() + 0.05;
            while (batch->outstanding && now_s() < d2) ucp_worker_progress(self->worker);
            if (batch->outstanding) {
                for (Py_ssize_t i = 0; i < window; i++) {
                    get_slot_t *s = &batch->slots[i];
                    if (!s->req) continue;
                    EndpointObject *eo = E[s->ep_idx];
                    if (eo->ep && eo->peer_mode) {
                        if (eo->failed == UCS_OK) eo->failed = UCS_ERR_TIMED_OUT;
                        ep_close_locked(eo, 1, 1.0);
                    }
                }
            }
            /* Completion after a force close is local to UCX; the bound only guards
             * against a UCX that never completes them (then the batch is leaked and the
             * caller is told the destination may still be written). */
            d2 = now_s() + 30.0;
            while (batch->outstanding && now_s() < d2) ucp_worker_progress(self->worker);
            remaining_after = batch->outstanding;
            if (remaining_after) leak_batch = 1; /* callbacks may still reference it */
        }
        st = batch->first_err;
    }
    elapsed = now_s() - t0;
    pthread_mutex_unlock(&self->lock);
    Py_END_ALLOW_THREADS

    if (closed_mid) {
        PyErr_SetString(UcxError, "worker is closed");
        goto out;
    }
    if (bad_obj >= 0) {
        PyErr_Format(UcxError, "%s %lld is closed",
                     bad_obj < (int64_t)neps ? "endpoint"
                     : bad_obj < (int64_t)(neps + nrks) ? "rkey" : "memh",
                     (long long)(bad_obj < (int64_t)neps ? bad_obj
                                 : bad_obj < (int64_t)(neps + nrks) ? bad_obj - (int64_t)neps
                                 : bad_obj - (int64_t)(neps + nrks)));
        goto out;
    }
    if (timed_out) {
        raise_ucx(UCS_ERR_TIMED_OUT,
                  "batched get timed out after %.3f s (%zu of %zu rows posted; %zu still outstanding "
                  "after cancel%s)",
                  elapsed, posted, n, remaining_after,
                  remaining_after ? ", destination may still be written" : "");
        goto out;
    }
    if (st != UCS_OK) {
        long long row = (long long)batch->err_row;
        const uint64_t *r = rows + (row >= 0 ? (size_t)row : 0) * ncol;
        raise_ucx(st, "ucp_get_nbx failed at plan row %lld (endpoint %llu, rkey %llu, %llu bytes)", row,
                  (unsigned long long)r[0], (unsigned long long)r[1], (unsigned long long)r[4]);
        /* .row for callers */
        PyObject *et, *ev, *tb;
        PyErr_Fetch(&et, &ev, &tb);
        PyErr_NormalizeException(&et, &ev, &tb);
        if (ev) {
            PyObject *ro = PyLong_FromLongLong(row);
            PyObject *eo = PyLong_FromUnsignedLongLong(r[0]);
            if (ro) PyObject_SetAttrString(ev, "row", ro);
            if (eo) PyObject_SetAttrString(ev, "endpoint", eo);
            Py_XDECREF(ro);
            Py_XDECREF(eo);
        }
        PyErr_Restore(et, ev, tb);
        goto out;
    }
    result = Py_None;
    Py_INCREF(result);
out:
    PyBuffer_Release(&pb);
    Py_XDECREF(eps_f);
    Py_XDECREF(rks_f);
    Py_XDECREF(mhs_f);
    PyMem_RawFree(c_eps);
    PyMem_RawFree(c_rks);
    PyMem_RawFree(c_mhs);
    PyMem_RawFree(used);
    if (batch && !leak_batch) {
        PyMem_RawFree(batch->slots);
        PyMem_RawFree(batch);
    }
    return result;
}

static PyMethodDef Worker_methods[] = {
    {"close", (PyCFunction)Worker_close, METH_NOARGS,
     "close(): close endpoints (rkeys first), unmap memory, stop the progress thread, destroy worker "
     "and context. Idempotent."},
    {"info", (PyCFunction)Worker_info, METH_NOARGS, "info() -> str: ucp context + worker description."},
    {"connect", (PyCFunction)(void (*)(void))Worker_connect, METH_VARARGS | METH_KEYWORDS,
     "connect(address: bytes, peer_error_handling: bool = True) -> Endpoint"},
    {"mem_map", (PyCFunction)(void (*)(void))Worker_mem_map, METH_VARARGS | METH_KEYWORDS,
     "mem_map(address: int, length: int, memory_type: int = MEMORY_TYPE_UNKNOWN) -> MemHandle. "
     "Registers existing memory (UCX allocates nothing)."},
    {"get", (PyCFunction)(void (*)(void))Worker_get, METH_VARARGS | METH_KEYWORDS,
     "get(plan, endpoints, rkeys, memhs=None, timeout=-1.0, window=256) -> None\n\n"
     "plan: C-contiguous (n, 5|6) 64-bit integer array of rows (endpoint index, rkey index, remote "
     "address, local address, length[, memh index or 2**64-1]). Runs the whole plan with at most "
     "`window` outstanding ucp_get_nbx requests and the GIL released. timeout < 0: no deadline; "
     "otherwise, at the deadline, outstanding requests are cancelled (PEER-mode endpoints "
     "holding some are force-closed), their completions are waited for, so nothing writes "
     "into the destination after the call returned, and UcxError(status=UCS_ERR_TIMED_OUT) is "
     "raised."},
    {NULL}};

static PyGetSetDef Worker_getset[] = {
    {"address", (getter)Worker_get_address, NULL, "worker address bytes", NULL},
    {"closed", (getter)Worker_get_closed, NULL, "closed flag", NULL},
    {"progress_thread", (getter)Worker_get_thread, NULL, "whether the progress thread runs", NULL},
    {"efd_mode", (getter)Worker_get_efd_mode, NULL, "progress thread sleeps on the worker event fd",
     NULL},
    {NULL}};

static PyTypeObject WorkerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "astate_store._ucx.Worker",
    .tp_basicsize = sizeof(WorkerObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Worker(config: dict[str, str] | None = None, progress_thread: bool = False, "
              "wakeup: bool = True, poll_us: int = 200)\n\n"
              "A UCP context (features RMA[+WAKEUP]) and one worker. Configuration comes from UCX's "
              "environment (UCX_TLS, UCX_NET_DEVICES, ...); `config` entries override it "
              "(keys with or without the UCX_ prefix). progress_thread starts a background thread "
              "that keeps progressing the worker (sleeping on the worker event fd when wakeup is "
              "on, else progressing every poll_us microseconds).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Worker_init,
    .tp_dealloc = (destructor)Worker_dealloc,
    .tp_methods = Worker_methods,
    .tp_getset = Worker_getset,
};

/* ---------------------------------------------------------------- Endpoint */

static void Endpoint_dealloc(EndpointObject *self)
{
    WorkerObject *w = self->w;
    if (w) {
        if (w_live(w)) {
            lock_gil_free(w);
            if (self->ep && !w->closed) ep_close_locked(self, ep_default_force(self), 1.0);
            wunlock(w);
        }
        self->w = NULL;
        Py_DECREF(w);
    }
    PyObject_Free(self);
}

static PyObject *Endpoint_close(EndpointObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"force", "timeout", NULL};
    PyObject *force_o = Py_None;
    double timeout = 1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|Od", kwlist, &force_o, &timeout)) return NULL;
    WorkerObject *w = self->w;
    if (!w_live(w)) Py_RETURN_NONE;
    int force = force_o == Py_None ? -1 : PyObject_IsTrue(force_o);
    if (force_o != Py_None && force < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    if (self->ep && !w->closed) {
        int f = force < 0 ? ep_default_force(self) : force;
        /* errors closing a failed/unreachable endpoint are already known: ignored */
        (void)ep_close_locked(self, f, timeout);
    }
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Endpoint_flush(EndpointObject *self, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"timeout", NULL};
    double timeout = -1.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "|d", kwlist, &timeout)) return NULL;
    WorkerObject *w = self->w;
    if (!w_live(w) || self->ep == NULL) {
        PyErr_SetString(UcxError, "endpoint is closed");
        return NULL;
    }
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    if (self->ep == NULL || w->closed) {
        st = UCS_ERR_NOT_CONNECTED;
    } else if (self->failed != UCS_OK) {
        st = self->failed;
    } else {
        ucp_request_param_t p;
        memset(&p, 0, sizeof(p));
        void *req = ucp_ep_flush_nbx(self->ep, &p);
        st = wait_req_locked(w, req, timeout);
        if (st == UCS_OK && self->failed != UCS_OK) st = self->failed;
    }
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    if (st != UCS_OK) return raise_ucx(st, "endpoint flush failed");
    Py_RETURN_NONE;
}

static PyObject *Endpoint_unpack_rkey(EndpointObject *self, PyObject *args)
{
    Py_buffer buf;
    if (!PyArg_ParseTuple(args, "y*", &buf)) return NULL;
    WorkerObject *w = self->w;
    if (!w_live(w)) {
        PyBuffer_Release(&buf);
        return raise_ucx(UCS_ERR_NOT_CONNECTED, "ucp_ep_rkey_unpack failed");
    }
    const char *bad = check_rkey_blob((const unsigned char *)buf.buf, (size_t)buf.len);
    if (bad != NULL) {
        Py_ssize_t blen = buf.len;
        PyBuffer_Release(&buf);
        return raise_ucx(UCS_ERR_INVALID_PARAM, "refusing a packed rkey of %zd bytes: %s", blen, bad);
    }
    /* ucp_ep_rkey_unpack takes no length: a zero-padded copy bounds what it can read */
    void *kbuf = padded_copy(buf.buf, (size_t)buf.len);
    PyBuffer_Release(&buf);
    if (kbuf == NULL) return PyErr_NoMemory();
    RkeyObject *r = PyObject_New(RkeyObject, &RkeyType);
    if (r == NULL) {
        PyMem_RawFree(kbuf);
        return NULL;
    }
    Py_INCREF(self);
    r->e = self;
    r->rkey = NULL;
    r->prev = r->next = NULL;
    ucs_status_t st;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&w->lock);
    if (self->ep == NULL || w->closed) {
        st = UCS_ERR_NOT_CONNECTED;
    } else {
        ucp_rkey_h rk = NULL;
        st = ucp_ep_rkey_unpack(self->ep, kbuf, &rk);
        if (st == UCS_OK) {
            r->rkey = rk;
            LIST_PUSH(self->rkeys, r);
        }
    }
    pthread_mutex_unlock(&w->lock);
    Py_END_ALLOW_THREADS
    PyMem_RawFree(kbuf);
    if (st != UCS_OK) {
        Py_DECREF(r);
        return raise_ucx(st, "ucp_ep_rkey_unpack failed");
    }
    return (PyObject *)r;
}

static PyObject *Endpoint_info(EndpointObject *self, PyObject *noargs)
{
    WorkerObject *w = self->w;
    char *s = NULL;
    size_t len = 0;
    if (w_live(w)) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->lock);
        if (self->ep && !w->closed) s = capture_print(print_ep, self->ep, &len);
        pthread_mutex_unlock(&w->lock);
        Py_END_ALLOW_THREADS
    }
    if (s == NULL) {
        PyErr_SetString(UcxError, "endpoint is closed");
        return NULL;
    }
    PyObject *r = PyUnicode_DecodeUTF8(s, (Py_ssize_t)len, "replace");
    free(s);
    return r;
}

static PyObject *Endpoint_get_failed(EndpointObject *self, void *c)
{
    return PyLong_FromLong((long)self->failed);
}

static PyObject *Endpoint_get_error(EndpointObject *self, void *c)
{
    if (self->failed == UCS_OK) Py_RETURN_NONE;
    return PyUnicode_FromString(ucs_status_string(self->failed));
}

static PyObject *Endpoint_get_closed(EndpointObject *self, void *c)
{
    return PyBool_FromLong(self->ep == NULL);
}

static PyObject *Endpoint_get_peer_mode(EndpointObject *self, void *c)
{
    return PyBool_FromLong(self->peer_mode);
}

static PyMethodDef Endpoint_methods[] = {
    {"close", (PyCFunction)(void (*)(void))Endpoint_close, METH_VARARGS | METH_KEYWORDS,
     "close(force=None, timeout=1.0): destroy its rkeys, then close. force=None: force only a "
     "failed PEER-mode endpoint. Never raises for a dead peer."},
    {"flush", (PyCFunction)(void (*)(void))Endpoint_flush, METH_VARARGS | METH_KEYWORDS,
     "flush(timeout=-1.0): wait until the endpoint is connected and idle; raises UcxError."},
    {"unpack_rkey", (PyCFunction)Endpoint_unpack_rkey, METH_VARARGS,
     "unpack_rkey(packed: bytes) -> RemoteKey. The blob (at most 4096 bytes) is checked against "
     "UCX's packed-rkey layout first (UcxError status ERR_INVALID_PARAM if implausible)."},
    {"info", (PyCFunction)Endpoint_info, METH_NOARGS, "info() -> str: lanes/transports in use."},
    {NULL}};

static PyGetSetDef Endpoint_getset[] = {
    {"failed", (getter)Endpoint_get_failed, NULL, "UCS status reported by the error handler (0: ok)",
     NULL},
    {"error", (getter)Endpoint_get_error, NULL, "status text of the failure, or None", NULL},
    {"closed", (getter)Endpoint_get_closed, NULL, "closed flag", NULL},
    {"peer_error_handling", (getter)Endpoint_get_peer_mode, NULL, "PEER error handling mode", NULL},
    {NULL}};

static PyTypeObject EndpointType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "astate_store._ucx.Endpoint",
    .tp_basicsize = sizeof(EndpointObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An endpoint to a remote worker; create with Worker.connect().",
    .tp_dealloc = (destructor)Endpoint_dealloc,
    .tp_methods = Endpoint_methods,
    .tp_getset = Endpoint_getset,
};

/* ---------------------------------------------------------------- RemoteKey */

static void Rkey_dealloc(RkeyObject *self)
{
    EndpointObject *e = self->e;
    if (e) {
        WorkerObject *w = e->w;
        if (w_live(w)) {
            lock_gil_free(w);
            rkey_destroy_locked(self);
            wunlock(w);
        }
        self->e = NULL;
        Py_DECREF(e);
    }
    PyObject_Free(self);
}

static PyObject *Rkey_destroy(RkeyObject *self, PyObject *noargs)
{
    EndpointObject *e = self->e;
    if (e && w_live(e->w)) {
        WorkerObject *w = e->w;
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->lock);
        rkey_destroy_locked(self);
        pthread_mutex_unlock(&w->lock);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Rkey_get_closed(RkeyObject *self, void *c) { return PyBool_FromLong(self->rkey == NULL); }

static PyObject *Rkey_get_endpoint(RkeyObject *self, void *c)
{
    if (!self->e) Py_RETURN_NONE;
    Py_INCREF(self->e);
    return (PyObject *)self->e;
}

static PyMethodDef Rkey_methods[] = {
    {"destroy", (PyCFunction)Rkey_destroy, METH_NOARGS, "destroy(): ucp_rkey_destroy. Idempotent."},
    {NULL}};

static PyGetSetDef Rkey_getset[] = {
    {"closed", (getter)Rkey_get_closed, NULL, "destroyed flag", NULL},
    {"endpoint", (getter)Rkey_get_endpoint, NULL, "the endpoint it was unpacked on", NULL},
    {NULL}};

static PyTypeObject RkeyType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "astate_store._ucx.RemoteKey",
    .tp_basicsize = sizeof(RkeyObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "An unpacked remote key; create with Endpoint.unpack_rkey().",
    .tp_dealloc = (destructor)Rkey_dealloc,
    .tp_methods = Rkey_methods,
    .tp_getset = Rkey_getset,
};

/* ---------------------------------------------------------------- MemHandle */

static void Mem_dealloc(MemObject *self)
{
    WorkerObject *w = self->w;
    if (w) {
        if (w_live(w)) {
            lock_gil_free(w);
            if (!w->closed) mem_unmap_locked(self);
            wunlock(w);
        }
        self->w = NULL;
        Py_DECREF(w);
    }
    Py_CLEAR(self->packed);
    PyObject_Free(self);
}

static PyObject *Mem_unmap(MemObject *self, PyObject *noargs)
{
    WorkerObject *w = self->w;
    if (w_live(w)) {
        Py_BEGIN_ALLOW_THREADS
        pthread_mutex_lock(&w->lock);
        if (!w->closed) mem_unmap_locked(self);
        pthread_mutex_unlock(&w->lock);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

static PyObject *Mem_rkey(MemObject *self, PyObject *noargs)
{
    if (self->packed == NULL || self->memh == NULL) {
        PyErr_SetString(UcxError, "memory handle is unmapped");
        return NULL;
    }
    Py_INCREF(self->packed);
    return self->packed;
}

static PyObject *Mem_get_address(MemObject *self, void *c) { return PyLong_FromUnsignedLongLong(self->address); }
static PyObject *Mem_get_length(MemObject *self, void *c) { return PyLong_FromUnsignedLongLong(self->length); }
static PyObject *Mem_get_mtype(MemObject *self, void *c) { return PyLong_FromLong(self->memory_type); }
static PyObject *Mem_get_closed(MemObject *self, void *c) { return PyBool_FromLong(self->memh == NULL); }

static PyMethodDef Mem_methods[] = {
    {"rkey", (PyCFunction)Mem_rkey, METH_NOARGS, "rkey() -> bytes: the packed remote key"},
    {"unmap", (PyCFunction)Mem_unmap, METH_NOARGS, "unmap(): ucp_mem_unmap. Idempotent."},
    {NULL}};

static PyGetSetDef Mem_getset[] = {
    {"address", (getter)Mem_get_address, NULL, "registered base address", NULL},
    {"length", (getter)Mem_get_length, NULL, "registered length", NULL},
    {"memory_type", (getter)Mem_get_mtype, NULL, "memory type passed to ucp_mem_map", NULL},
    {"closed", (getter)Mem_get_closed, NULL, "unmapped flag", NULL},
    {NULL}};

static PyTypeObject MemType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "astate_store._ucx.MemHandle",
    .tp_basicsize = sizeof(MemObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "A ucp_mem_map registration of existing memory; create with Worker.mem_map().",
    .tp_dealloc = (destructor)Mem_dealloc,
    .tp_methods = Mem_methods,
    .tp_getset = Mem_getset,
};

/* ---------------------------------------------------------------- same-host reads */

/*
 * run_jobs: fn over nj jobs (an array of job_size-byte structs), jobs 1.. on their own threads
 * and job 0 on this one; a job whose thread cannot start runs here. Returns when all are done.
 */
#define MAX_JOBS 16
static void run_jobs(void *(*fn)(void *), void *jobs, size_t job_size, int nj)
{
    pthread_t tids[MAX_JOBS];
    int started[MAX_JOBS] = {0};
    char *base = jobs;
    if (nj > MAX_JOBS) nj = MAX_JOBS;
    for (int t = 1; t < nj; t++)
        started[t] = pthread_create(&tids[t], NULL, fn, base + (size_t)t * job_size) == 0;
    for (int t = 1; t < nj; t++)
        if (!started[t]) fn(base + (size_t)t * job_size);
    fn(base);
    for (int t = 1; t < nj; t++)
        if (started[t]) pthread_join(tids[t], NULL);
}

/*
 * get_rows: a C-contiguous (n, ncols) buffer of 64-bit integers (a plan of rows), or -1 with
 * ValueError naming the columns. On success the caller releases pb.
 */
static int get_rows(PyObject *obj, Py_buffer *pb, Py_ssize_t ncols, const char *columns)
{
    if (PyObject_GetBuffer(obj, pb, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | PyBUF_ND) != 0) return -1;
    const char *fmt = pb->format ? pb->format : "B";
    if (*fmt == '<' || *fmt == '=' || *fmt == '@') fmt++;
    if (pb->itemsize != 8 || strchr("qQlL", fmt[0]) == NULL || fmt[1] != 0 || pb->ndim != 2 ||
        pb->shape[1] != ncols) {
        PyBuffer_Release(pb);
        PyErr_Format(PyExc_ValueError, "plan must be a C-contiguous 2-D array of 64-bit integers with %zd columns %s",
                     ncols, columns);
        return -1;
    }
    return 0;
}

/*
 * rows_call: the arguments (plan, threads=, split_bytes=[, streaming=]) of cma_read and copy_rows
 * (streaming only where the pointer is given); threads
 * clamped to 1..MAX_JOBS, split_bytes left at the caller's default when not given. On success the
 * caller releases pb.
 */
static int rows_call(PyObject *args, PyObject *kwds, Py_buffer *pb, Py_ssize_t ncols, const char *columns,
                     int *threads, unsigned long long *split, int *streaming)
{
    static char *kwlist[] = {"plan", "threads", "split_bytes", NULL};
    static char *kwlist_streaming[] = {"plan", "threads", "split_bytes", "streaming", NULL};
    PyObject *plan_obj;
    const int ok = streaming
        ? PyArg_ParseTupleAndKeywords(args, kwds, "O|iKi", kwlist_streaming, &plan_obj, threads, split, streaming)
        : PyArg_ParseTupleAndKeywords(args, kwds, "O|iK", kwlist, &plan_obj, threads, split);
    if (!ok) return -1;
    if (get_rows(plan_obj, pb, ncols, columns) != 0) return -1;
    if (*threads < 1) *threads = 1;
    if (*threads > MAX_JOBS) *threads = MAX_JOBS;
    return 0;
}

/*
 * cma_read(plan, threads=1, split_bytes=64 MiB): run rows (pid, remote_addr, local_addr,
 * length) with process_vm_readv, up to CMA_IOV pairs per syscall, GIL released. Only the
 * Python layer decides which rows may go here (same-node peer, host memory) and bounds-
 * checks them. Consecutive rows of one pid share a syscall; a short return resumes inside
 * the iovec where it stopped. With threads > 1 and more than split_bytes in total, the
 * rows are cut into byte-balanced contiguous ranges, one per thread.
 * Errors raise OSError(errno) with .pid and .row (first row of the failing batch).
 */
#define CMA_IOV 1024 /* IOV_MAX */

typedef struct {
    const uint64_t *rows;
    size_t lo, hi;
    int err;
    size_t err_row;
    uint64_t err_pid;
} cma_job_t;

static void *cma_job(void *arg)
{
    cma_job_t *j = arg;
    struct iovec liov[CMA_IOV], riov[CMA_IOV];
    size_t i = j->lo;
    while (i < j->hi) {
        const uint64_t pid = j->rows[4 * i];
        const size_t first = i;
        int k = 0;
        for (; i < j->hi && k < CMA_IOV && j->rows[4 * i] == pid; i++) {
            const uint64_t *r = j->rows + 4 * i;
            if (r[3] == 0) continue;
            riov[k].iov_base = (void *)(uintptr_t)r[1];
            liov[k].iov_base = (void *)(uintptr_t)r[2];
            riov[k].iov_len = liov[k].iov_len = (size_t)r[3];
            k++;
        }
        int s = 0; /* first iovec pair not yet fully read */
        while (s < k) {
            ssize_t got = process_vm_readv((pid_t)pid, liov + s, (unsigned long)(k - s), riov + s,
                                           (unsigned long)(k - s), 0);
            if (got <= 0) {
                if (got < 0 && errno == EINTR) continue;
                j->err = got < 0 ? errno : EFAULT; /* 0 bytes with work left: no progress */
                j->err_row = first;
                j->err_pid = pid;
                return NULL;
            }
            size_t g = (size_t)got;
            while (s < k && g >= liov[s].iov_len) g -= liov[s++].iov_len;
            if (g) { /* stopped inside pair s */
                liov[s].iov_base = (char *)liov[s].iov_base + g;
                riov[s].iov_base = (char *)riov[s].iov_base + g;
                liov[s].iov_len -= g;
                riov[s].iov_len -= g;
            }
        }
    }
    return NULL;
}

static PyObject *mod_cma_read(PyObject *m, PyObject *args, PyObject *kwds)
{
    Py_buffer pb;
    int threads = 1;
    unsigned long long split = 64ull << 20;
    if (rows_call(args, kwds, &pb, 4, "(pid, remote_addr, local_addr, length)", &threads, &split, NULL) != 0) return NULL;
    const uint64_t *rows = (const uint64_t *)pb.buf;
    const size_t n = (size_t)pb.shape[0];
    cma_job_t jobs[MAX_JOBS];
    int nj = 1;

    Py_BEGIN_ALLOW_THREADS
    uint64_t total = 0;
    if (threads > 1)
        for (size_t i = 0; i < n; i++) total += rows[4 * i + 3];
    if (threads > 1 && total > split) nj = threads;
    /* byte-balanced contiguous ranges: job t ends where the running sum passes (t+1)/nj */
    uint64_t acc = 0;
    size_t i = 0;
    for (int t = 0; t < nj; t++) {
        jobs[t] = (cma_job_t){rows, i, n, 0, 0, 0};
        if (t < nj - 1) {
            const uint64_t want = total / (uint64_t)nj * (uint64_t)(t + 1);
            while (i < n && acc < want) acc += rows[4 * i++ + 3];
            jobs[t].hi = i;
        }
    }
    run_jobs(cma_job, jobs, sizeof(jobs[0]), nj);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&pb);
    for (int t = 0; t < nj; t++) {
        if (!jobs[t].err) continue;
        PyObject *exc = PyObject_CallFunction(PyExc_OSError, "is", jobs[t].err, strerror(jobs[t].err));
        if (exc == NULL) return NULL;
        PyObject *pid = PyLong_FromUnsignedLongLong(jobs[t].err_pid);
        PyObject *row = PyLong_FromSize_t(jobs[t].err_row);
        if (pid && row) {
            PyObject_SetAttrString(exc, "pid", pid);
            PyObject_SetAttrString(exc, "row", row);
        }
        Py_XDECREF(pid);
        Py_XDECREF(row);
        PyErr_SetObject((PyObject *)Py_TYPE(exc), exc);
        Py_DECREF(exc);
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---------------------------------------------------------------- mapped copies */

/*
 * copy_rows(plan, threads=1, split_bytes=8 MiB, streaming=-1): rows (src_addr, dst_addr,
 * length) copied, GIL released: the same-host path for peer regions mapped into this process
 * (memfd staging; the Python layer maps, proves and bounds-checks every row) and the put's copy
 * into staging. Python checks nothing here: rows must be valid.
 *
 * Threads: with threads > 1 and more than split_bytes in total, the concatenated bytes are cut
 * into chunks (cutting inside rows where needed, so one huge row still spreads) that the
 * threads take in turn from a shared counter. A fixed share per thread made the whole copy
 * wait for the thread that lost its core for a while: on a small host other processes' threads
 * (a publisher's progress thread, etcd) take a core often enough to matter.
 *
 * Streaming: a copy of more than a last-level cache (STREAM_MIN) writes its destination with
 * non-temporal stores (streaming = -1: by size; 0: never; 1: always). Plain stores first read
 * every destination line into the cache (read for ownership) and later write it back, so a
 * large copy moves three bytes of memory traffic per byte copied; streaming stores move two.
 * glibc's memcpy does the same, but only for one call above its threshold (192 MiB here), and
 * a plan's rows are kilobytes each. Measured on the 2-core dev VM, 1 GiB in 8-1024 KiB rows,
 * two threads: 10.5-16 GB/s streaming against 6.4-10.4 with memcpy (torch copy_: 6.5-11).
 * The bytes are the same either way; an sfence ends each thread's copy so its stores are
 * visible before the call returns.
 */
#define STREAM_MIN (32ull << 20)
#define CHUNK_MIN (1ull << 20)
#define CHUNK_MAX (8ull << 20)

#if defined(__SSE2__)
#include <emmintrin.h>
#define HAVE_STREAM 1
/* dst aligned to 64 bytes by a short memcpy, then 64-byte blocks of streaming stores */
static void stream_copy(char *d, const char *s, size_t n)
{
    size_t head = (64 - ((uintptr_t)d & 63)) & 63;
    if (head > n) head = n;
    memcpy(d, s, head);
    d += head, s += head, n -= head;
    const size_t body = n & ~(size_t)63;
    for (size_t i = 0; i < body; i += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(s + i));
        const __m128i b = _mm_loadu_si128((const __m128i *)(s + i + 16));
        const __m128i c = _mm_loadu_si128((const __m128i *)(s + i + 32));
        const __m128i e = _mm_loadu_si128((const __m128i *)(s + i + 48));
        _mm_stream_si128((__m128i *)(d + i), a);
        _mm_stream_si128((__m128i *)(d + i + 16), b);
        _mm_stream_si128((__m128i *)(d + i + 32), c);
        _mm_stream_si128((__m128i *)(d + i + 48), e);
    }
    memcpy(d + body, s + body, n - body);
}
#else
#define HAVE_STREAM 0
#endif

typedef struct {
    const uint64_t *rows;
    size_t n;           /* rows in the plan */
    size_t nchunks;
    const size_t *row;  /* per chunk: its first row */
    const uint64_t *skip; /* per chunk: bytes of that row owned by earlier chunks */
    uint64_t chunk, total;
    int streaming;
    size_t next;        /* next chunk to take (atomic) */
} copy_plan_t;

static void copy_chunk(const copy_plan_t *p, size_t c)
{
    size_t i = p->row[c];
    uint64_t skip = p->skip[c];
    const uint64_t lo = (uint64_t)c * p->chunk;
    uint64_t todo = (c == p->nchunks - 1 ? p->total : lo + p->chunk) - lo;
    for (; todo && i < p->n; i++, skip = 0) {
        const uint64_t *r = p->rows + 3 * i;
        uint64_t len = r[2] - skip;
        if (len > todo) len = todo;
        char *d = (char *)(uintptr_t)(r[1] + skip);
        const char *s = (const char *)(uintptr_t)(r[0] + skip);
#if HAVE_STREAM
        if (p->streaming) stream_copy(d, s, (size_t)len);
        else
#endif
            memcpy(d, s, (size_t)len);
        todo -= len;
    }
}

static void *copy_worker(void *arg)
{
    copy_plan_t *p = *(copy_plan_t **)arg;
    size_t c;
    while ((c = __atomic_fetch_add(&p->next, 1, __ATOMIC_RELAXED)) < p->nchunks) copy_chunk(p, c);
#if HAVE_STREAM
    if (p->streaming) _mm_sfence();
#endif
    return NULL;
}

/* chunk starts: chunk c begins at byte c*chunk of the concatenated rows */
static void plan_chunks(copy_plan_t *p, size_t *row, uint64_t *skip)
{
    size_t i = 0;
    uint64_t before = 0; /* bytes of rows[0..i) */
    for (size_t c = 0; c < p->nchunks; c++) {
        const uint64_t lo = (uint64_t)c * p->chunk;
        while (i < p->n && before + p->rows[3 * i + 2] <= lo) before += p->rows[3 * i++ + 2];
        row[c] = i;
        skip[c] = lo - before;
    }
}

static PyObject *mod_copy_rows(PyObject *m, PyObject *args, PyObject *kwds)
{
    Py_buffer pb;
    int threads = 1, streaming = -1, nomem = 0;
    unsigned long long split = 8ull << 20;
    if (rows_call(args, kwds, &pb, 3, "(src_addr, dst_addr, length)", &threads, &split, &streaming) != 0)
        return NULL;
    copy_plan_t p = {(const uint64_t *)pb.buf, (size_t)pb.shape[0], 1, NULL, NULL, 0, 0, 0, 0};
    copy_plan_t *jobs[MAX_JOBS];
    for (int t = 0; t < MAX_JOBS; t++) jobs[t] = &p;

    Py_BEGIN_ALLOW_THREADS
    for (size_t i = 0; i < p.n; i++) p.total += p.rows[3 * i + 2];
    p.streaming = HAVE_STREAM && (streaming > 0 || (streaming < 0 && p.total >= STREAM_MIN));
    const int nj = (threads > 1 && p.total > split) ? threads : 1;
    p.chunk = p.total ? p.total : 1;
    if (nj > 1) {
        p.chunk = p.total / ((uint64_t)nj * 64);
        p.chunk = p.chunk < CHUNK_MIN ? CHUNK_MIN : p.chunk > CHUNK_MAX ? CHUNK_MAX : p.chunk;
        p.nchunks = (size_t)((p.total + p.chunk - 1) / p.chunk);
    }
    size_t *row = PyMem_RawMalloc(p.nchunks * sizeof(size_t));
    uint64_t *skip = PyMem_RawMalloc(p.nchunks * sizeof(uint64_t));
    if (row == NULL || skip == NULL) {
        nomem = 1;
    } else {
        p.row = row, p.skip = skip;
        plan_chunks(&p, row, skip);
        run_jobs(copy_worker, jobs, sizeof(jobs[0]), nj);
    }
    PyMem_RawFree(row);
    PyMem_RawFree(skip);
    Py_END_ALLOW_THREADS

    PyBuffer_Release(&pb);
    if (nomem) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/*
 * sock_rows(fd, rows, send, timeout=-1, stall=120, lowat=0): move the bytes of rows (addr,
 * length) over the connected stream socket fd, in row order: sendmsg from them (send=1) or
 * recvmsg into them (send=0), IOV_MAX buffers a call, GIL released. Why in C: the Python loop
 * rebuilt a list of up to 1,024 memoryviews per call and took a buffer of each, which cost as
 * much as the kernel's copies on a 2-core host. Only the Python layer decides which addresses
 * may go here (its own plan rows, or a served region's checked rows).
 *
 * The socket may be non-blocking (a Python socket with a timeout is): calls use MSG_DONTWAIT
 * and wait in poll(). Timeouts: TimeoutError once no byte moved for `stall` seconds, or once
 * `timeout` seconds passed in all (timeout < 0: no overall limit).
 *
 * lowat > 0 (receive): SO_RCVLOWAT of min(lowat, bytes still expected), so the kernel wakes this
 * thread once that much has arrived rather than per segment (fewer wake-ups of the three
 * processes sharing two cores; measured +10-25% over loopback). Never more than is still
 * expected: the kernel's wake-up compares the queue with SO_RCVLOWAT, not with what the reader
 * asked, so a larger value left over the stream's tail would sleep forever. Polls are also
 * bounded (SOCK_POLL_S) and followed by a non-blocking recvmsg, which returns what is queued
 * whatever SO_RCVLOWAT says, so a missed wake-up costs latency, never a hang. Reset to 1 after
 * (the kernel also grows the receive buffer to fit the mark, and keeps that: harmless, the
 * autotuning grows it past that anyway on a busy stream).
 *
 * A signal (Ctrl-C) stops the loop at the next poll (at most SOCK_POLL_S) with its exception.
 *
 * Raises TimeoutError, ConnectionError (closed by the peer before every byte moved) or
 * OSError(errno) (EFAULT: a destination that is not host memory).
 */
#define SOCK_IOV 1024
#define SOCK_POLL_S 0.2

typedef struct {
    int fd, send, lowat, lowat_set;
    double deadline, stall, last_progress;
    uint64_t left; /* bytes still to move */
    int err, closed, timedout, interrupted;
    uint64_t moved;
} sock_job_t;

/* A signal handler raised (Ctrl-C on the main thread): checked with the GIL taken back for a
 * moment, after a poll that timed out or was interrupted, so a stalled read stops at once. */
static int sock_signalled(sock_job_t *j)
{
    PyGILState_STATE g = PyGILState_Ensure();
    const int raised = PyErr_CheckSignals() != 0; /* the exception stays set for the caller */
    PyGILState_Release(g);
    if (raised) j->interrupted = 1;
    return raised;
}

/* Wait until fd is ready or SOCK_POLL_S passed. 0: try again; -1: timed out or failed (set in j). */
static int sock_wait(sock_job_t *j)
{
    const double now = now_s();
    double left = j->last_progress + j->stall - now;
    if (j->deadline > 0 && j->deadline - now < left) left = j->deadline - now;
    if (left <= 0) {
        j->timedout = 1;
        return -1;
    }
    struct pollfd p = {j->fd, (short)(j->send ? POLLOUT : POLLIN), 0};
    const double wait = left < SOCK_POLL_S ? left : SOCK_POLL_S;
    const int r = poll(&p, 1, (int)(wait * 1000.0) + 1);
    if (r < 0 && errno != EINTR) {
        j->err = errno;
        return -1;
    }
    return r <= 0 && sock_signalled(j) ? -1 : 0;
}

static void sock_set_lowat(sock_job_t *j)
{
    if (j->send || j->lowat <= 0) return;
    const int want = (uint64_t)j->lowat < j->left ? j->lowat : (int)(j->left ? j->left : 1);
    if (want != j->lowat_set && setsockopt(j->fd, SOL_SOCKET, SO_RCVLOWAT, &want, sizeof want) == 0)
        j->lowat_set = want;
}

/* One batch of iovecs moved whole; 0, or -1 with the reason in j. */
static int sock_batch(sock_job_t *j, struct iovec *iov, int k)
{
    int s = 0; /* first iovec not yet fully moved */
    while (s < k) {
        sock_set_lowat(j);
        struct msghdr mh = {0};
        mh.msg_iov = iov + s;
        mh.msg_iovlen = (size_t)(k - s);
        const ssize_t got = j->send ? sendmsg(j->fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT)
                                    : recvmsg(j->fd, &mh, MSG_DONTWAIT);
        if (got < 0) {
            if (errno == EINTR) {
                if (sock_signalled(j)) return -1;
                continue;
            }
            if (errno != EAGAIN && errno != EWOULDBLOCK) {
                j->err = errno;
                return -1;
            }
            if (sock_wait(j) != 0) return -1;
            continue;
        }
        if (got == 0) {
            j->closed = 1;
            return -1;
        }
        size_t g = (size_t)got;
        j->moved += g;
        j->left -= g;
        j->last_progress = now_s();
        while (s < k && g >= iov[s].iov_len) g -= iov[s++].iov_len;
        if (g) {
            iov[s].iov_base = (char *)iov[s].iov_base + g;
            iov[s].iov_len -= g;
        }
    }
    return 0;
}

static void sock_move(sock_job_t *j, const uint64_t *rows, size_t n)
{
    struct iovec iov[SOCK_IOV];
    for (size_t r = 0; r < n; r++) j->left += rows[2 * r + 1];
    size_t i = 0;
    while (i < n) {
        int k = 0;
        for (; i < n && k < SOCK_IOV; i++) {
            if (rows[2 * i + 1] == 0) continue;
            iov[k].iov_base = (void *)(uintptr_t)rows[2 * i];
            iov[k].iov_len = (size_t)rows[2 * i + 1];
            k++;
        }
        if (sock_batch(j, iov, k) != 0) break;
    }
    if (j->lowat_set > 1) {
        const int one = 1;
        setsockopt(j->fd, SOL_SOCKET, SO_RCVLOWAT, &one, sizeof one);
    }
}

static PyObject *mod_sock_rows(PyObject *m, PyObject *args, PyObject *kwds)
{
    static char *kwlist[] = {"fd", "rows", "send", "timeout", "stall", "lowat", NULL};
    int fd, send, lowat = 0;
    double timeout = -1.0, stall = 120.0;
    PyObject *rows_obj;
    Py_buffer pb;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "iOp|ddi", kwlist, &fd, &rows_obj, &send, &timeout, &stall,
                                     &lowat))
        return NULL;
    if (fd < 0) {
        PyErr_SetString(PyExc_ValueError, "sock_rows: a closed socket (fd < 0)");
        return NULL;
    }
    if (get_rows(rows_obj, &pb, 2, "(addr, length)") != 0) return NULL;
    sock_job_t j = {0};
    j.fd = fd, j.send = send, j.lowat = lowat, j.stall = stall;
    Py_BEGIN_ALLOW_THREADS
    j.last_progress = now_s();
    j.deadline = timeout >= 0 ? j.last_progress + timeout : 0.0;
    sock_move(&j, (const uint64_t *)pb.buf, (size_t)pb.shape[0]);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&pb);
    if (j.interrupted) return NULL; /* the signal handler's exception (KeyboardInterrupt) */
    if (j.timedout)
        return PyErr_Format(PyExc_TimeoutError, "timed out (%llu bytes moved, %llu left)",
                            (unsigned long long)j.moved, (unsigned long long)j.left);
    if (j.closed)
        return PyErr_Format(PyExc_ConnectionError, "connection closed by the peer (%llu bytes moved, %llu left)",
                            (unsigned long long)j.moved, (unsigned long long)j.left);
    if (j.err) {
        errno = j.err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromUnsignedLongLong(j.moved);
}

/* ---------------------------------------------------------------- module */

static PyObject *mod_status_string(PyObject *m, PyObject *arg)
{
    long s = PyLong_AsLong(arg);
    if (s == -1 && PyErr_Occurred()) return NULL;
    return PyUnicode_FromString(ucs_status_string((ucs_status_t)s));
}

static PyObject *mod_version(PyObject *m, PyObject *noargs)
{
    unsigned maj, min, rel;
    ucp_get_version(&maj, &min, &rel);
    return Py_BuildValue("(III)", maj, min, rel);
}

static PyMethodDef module_methods[] = {
    {"status_string", mod_status_string, METH_O, "status_string(status: int) -> str"},
    {"version", mod_version, METH_NOARGS, "version() -> (major, minor, release) of the loaded libucp"},
    {"cma_read", (PyCFunction)(void (*)(void))mod_cma_read, METH_VARARGS | METH_KEYWORDS,
     "cma_read(plan, threads=1, split_bytes=64<<20): rows (pid, remote, local, length) via batched "
     "process_vm_readv, GIL released. Raises OSError (.pid, .row)."},
    {"sock_rows", (PyCFunction)(void (*)(void))mod_sock_rows, METH_VARARGS | METH_KEYWORDS,
     "sock_rows(fd, rows, send, timeout=-1, stall=120, lowat=0) -> int: rows (addr, length) sent from / "
     "received into over a stream socket, in order, GIL released. Raises TimeoutError, ConnectionError, OSError."},
    {"copy_rows", (PyCFunction)(void (*)(void))mod_copy_rows, METH_VARARGS | METH_KEYWORDS,
     "copy_rows(plan, threads=1, split_bytes=8<<20, streaming=-1): rows (src, dst, length) copied, GIL "
     "released, chunks taken by threads in turn; streaming stores above 32 MiB (-1), never (0), always (1)."},
    {NULL}};

static struct PyModuleDef moduledef = {
    PyModuleDef_HEAD_INIT, "astate_store._ucx",
    "Thin libucp binding: Worker, Endpoint, RemoteKey, MemHandle, UcxError.", -1, module_methods};

PyMODINIT_FUNC PyInit__ucx(void)
{
    PyObject *m = PyModule_Create(&moduledef);
    if (m == NULL) return NULL;
    atexit(stop_all_threads_at_exit);
    pthread_atfork(NULL, NULL, forget_threads_in_child);
    PyTypeObject *types[] = {&WorkerType, &EndpointType, &RkeyType, &MemType};
    const char *names[] = {"Worker", "Endpoint", "RemoteKey", "MemHandle"};
    for (int i = 0; i < 4; i++) {
        if (PyType_Ready(types[i]) < 0) goto fail;
        Py_INCREF(types[i]);
        if (PyModule_AddObject(m, names[i], (PyObject *)types[i]) < 0) goto fail;
    }
    UcxError = PyErr_NewExceptionWithDoc(
        "astate_store._ucx.UcxError",
        "A UCX failure. Attributes: status (int ucs_status_t, 0 if not from UCX), status_text.",
        NULL, NULL);
    if (UcxError == NULL) goto fail;
    PyObject_SetAttrString(UcxError, "status", PyLong_FromLong(0));
    PyObject_SetAttrString(UcxError, "status_text", Py_None);
    Py_INCREF(UcxError);
    if (PyModule_AddObject(m, "UcxError", UcxError) < 0) goto fail;

#define ADD_INT(name, val) if (PyModule_AddIntConstant(m, name, (long)(val)) < 0) goto fail
    ADD_INT("MEMORY_TYPE_HOST", UCS_MEMORY_TYPE_HOST);
    ADD_INT("MEMORY_TYPE_CUDA", UCS_MEMORY_TYPE_CUDA);
    ADD_INT("MEMORY_TYPE_CUDA_MANAGED", UCS_MEMORY_TYPE_CUDA_MANAGED);
    ADD_INT("MEMORY_TYPE_UNKNOWN", UCS_MEMORY_TYPE_UNKNOWN);
    ADD_INT("OK", UCS_OK);
    ADD_INT("ERR_IO_ERROR", UCS_ERR_IO_ERROR);
    ADD_INT("ERR_UNREACHABLE", UCS_ERR_UNREACHABLE);
    ADD_INT("ERR_INVALID_ADDR", UCS_ERR_INVALID_ADDR);
    ADD_INT("ERR_CANCELED", UCS_ERR_CANCELED);
    ADD_INT("ERR_TIMED_OUT", UCS_ERR_TIMED_OUT);
    ADD_INT("ERR_INVALID_PARAM", UCS_ERR_INVALID_PARAM);
    ADD_INT("MAX_WORKER_ADDRESS", MAX_WORKER_ADDRESS);
    ADD_INT("MAX_RKEY_BLOB", MAX_RKEY_BLOB);
    ADD_INT("ERR_REJECTED", UCS_ERR_REJECTED);
    ADD_INT("ERR_NOT_CONNECTED", UCS_ERR_NOT_CONNECTED);
    ADD_INT("ERR_CONNECTION_RESET", UCS_ERR_CONNECTION_RESET);
    ADD_INT("ERR_FIRST_LINK_FAILURE", UCS_ERR_FIRST_LINK_FAILURE);
    ADD_INT("ERR_LAST_LINK_FAILURE", UCS_ERR_LAST_LINK_FAILURE);
    ADD_INT("ERR_FIRST_ENDPOINT_FAILURE", UCS_ERR_FIRST_ENDPOINT_FAILURE);
    ADD_INT("ERR_LAST_ENDPOINT_FAILURE", UCS_ERR_LAST_ENDPOINT_FAILURE);
    ADD_INT("ERR_ENDPOINT_TIMEOUT", UCS_ERR_ENDPOINT_TIMEOUT);
#undef ADD_INT
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}
