/*
 * server_gate.c: the connection gate in front of libmicrohttpd.
 *
 * libmicrohttpd answers some requests itself, before any of our code sees
 * them: a malformed request line or header, an unknown HTTP version, a
 * header larger than its connection buffer. Those answers are HTML pages
 * (and for "Content-Length: -1" its status line went out twice), where an
 * OpenAI client expects a JSON error. So the server owns the listening
 * socket: the gate thread accepts each connection, waits (epoll, without
 * reading) until the request's head is complete, checks it with
 * cas_srv_head_check, and only then hands the socket to libmicrohttpd
 * (MHD_add_connection), which reads the same bytes again. A head that fails
 * the check gets our JSON error and the connection is closed. Later requests
 * of a kept-alive connection are libmicrohttpd's alone.
 *
 * While a connection waits in the gate the gate enforces what libmicrohttpd
 * would: the per-address limit, the total (evicting the oldest waiting
 * connection near it, as the HTTP layer does for its own), and the header
 * deadline. A connection refused at a limit gets a JSON 503 before it is
 * closed instead of a bare close.
 */
#include <errno.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "server_impl.h"

/* ---- the head check ------------------------------------------------------- */

static int tchar(unsigned char c) {
    return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || strchr("!#$%&'*+-.^_`|~", c);
}

/* The end of the head (just past its empty line), or 0 if it has not come. */
static size_t head_end(const char *b, size_t n) {
    for (size_t i = 0; i + 1 < n; i++) {
        if (b[i] != '\n') continue;
        if (b[i + 1] == '\n') return i + 2;
        if (b[i + 1] == '\r' && i + 2 < n && b[i + 2] == '\n') return i + 3;
    }
    return 0;
}

/* Trims optional whitespace around [*v, *v + *n). */
static void ows_trim(const char **v, size_t *n) {
    while (*n && (**v == ' ' || **v == '\t')) (*v)++, (*n)--;
    while (*n && ((*v)[*n - 1] == ' ' || (*v)[*n - 1] == '\t')) (*n)--;
}

int cas_srv_head_check(const char *b, size_t n, size_t max_header_bytes, cas_srv_error *err) {
    size_t end = head_end(b, n);
    if (!end) {
        if (n >= max_header_bytes) {
            cas_srv_error_set(err, 431, "invalid_request_error", "request_header_too_large", NULL,
                              "Request headers exceed the limit of %zu bytes", max_header_bytes);
            return -1;
        }
        return 0;
    }
    if (end > max_header_bytes) {
        cas_srv_error_set(err, 431, "invalid_request_error", "request_header_too_large", NULL,
                          "Request headers of %zu bytes exceed the limit of %zu bytes", end, max_header_bytes);
        return -1;
    }
    /* the request line: METHOD SP target SP HTTP/1.x */
    size_t i = 0;
    while (i < end && tchar((unsigned char)b[i])) i++;
    size_t t0 = i + 1, t1 = t0;
    if (i > 0 && i < end && b[i] == ' ') {
        while (t1 < end && b[t1] > ' ' && b[t1] < 127) t1++;
    }
    if (i == 0 || b[i] != ' ' || t1 == t0 || t1 >= end || b[t1] != ' ') {
        cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                          "Malformed HTTP request line");
        return -1;
    }
    const char *v = b + t1 + 1;
    size_t vl = 0;
    while (t1 + 1 + vl < end && v[vl] != '\r' && v[vl] != '\n') vl++;
    if (vl != 8 || strncmp(v, "HTTP/", 5) || v[6] != '.' || v[5] < '0' || v[5] > '9' || v[7] < '0' || v[7] > '9') {
        cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                          "Malformed HTTP version in the request line");
        return -1;
    }
    if (v[5] != '1') {
        cas_srv_error_set(err, 505, "invalid_request_error", "http_version_not_supported", NULL,
                          "HTTP/%c.%c is not supported: send HTTP/1.1 (or HTTP/1.0)", v[5], v[7]);
        return -1;
    }
    size_t p = t1 + 1 + vl;
    p += b[p] == '\r' ? 2 : 1;
    /* header fields: name ":" OWS value OWS, no folding, no control bytes */
    long long clen = -1;
    int chunked = 0;
    while (p < end) {
        size_t le = p;
        while (le < end && b[le] != '\n') le++;
        size_t ll = le - p;
        if (ll && b[le - 1] == '\r') ll--;
        if (ll == 0) break; /* the empty line */
        const char *line = b + p;
        size_t nl = 0;
        while (nl < ll && tchar((unsigned char)line[nl])) nl++;
        if (nl == 0 || nl == ll || line[nl] != ':') {
            cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                              "Malformed HTTP header line (a header is `Name: value`)");
            return -1;
        }
        const char *val = line + nl + 1;
        size_t vn = ll - nl - 1;
        for (size_t k = 0; k < vn; k++) {
            unsigned char c = (unsigned char)val[k];
            if ((c < ' ' && c != '\t') || c == 127) {
                cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                                  "Control character in the value of HTTP header %.*s", (int)(nl < 64 ? nl : 64), line);
                return -1;
            }
        }
        ows_trim(&val, &vn);
        if (nl == 14 && !strncasecmp(line, "Content-Length", 14)) {
            long long x = 0;
            int ok = vn > 0 && vn <= 18;
            for (size_t k = 0; ok && k < vn; k++) {
                if (val[k] < '0' || val[k] > '9') ok = 0;
                else x = x * 10 + (val[k] - '0');
            }
            if (!ok || (clen >= 0 && clen != x)) {
                cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                                  "Invalid Content-Length: %.*s", (int)(vn < 40 ? vn : 40), val);
                return -1;
            }
            clen = x;
        } else if (nl == 17 && !strncasecmp(line, "Transfer-Encoding", 17)) {
            if (vn != 7 || strncasecmp(val, "chunked", 7) || chunked) {
                cas_srv_error_set(err, 501, "invalid_request_error", "unsupported_transfer_encoding", NULL,
                                  "Transfer-Encoding %.*s is not supported (only chunked)", (int)(vn < 40 ? vn : 40), val);
                return -1;
            }
            chunked = 1;
        }
        p = le + 1;
    }
    if (chunked && clen >= 0) {
        cas_srv_error_set(err, 400, "invalid_request_error", "malformed_request", NULL,
                          "A request may not have both Content-Length and Transfer-Encoding");
        return -1;
    }
    return 1;
}

/* ---- the gate thread ------------------------------------------------------ */

typedef struct {
    int fd;
    struct sockaddr_storage addr;
    socklen_t alen;
    double since;
} gate_conn;

struct cas_srv_gate {
    cas_srv_gate_opts o;
    int ep;
    gate_conn *pend; /* connections whose head has not come yet, oldest first */
    int32_t n_pend, cap_pend;
    char *buf;       /* peek buffer, max_header_bytes + 1 */
    pthread_t thread;
    atomic_int stop;
};

/* Writes a JSON error and closes the connection. Unread bytes would make
 * close() reset the connection and possibly destroy the answer in flight,
 * so the rest of what the client sent is read (briefly) first. */
static void answer_close(int fd, const cas_srv_error *e, const char *replica) {
    char *js = cas_srv_error_json(e);
    const char *reason = e->status == 400   ? "Bad Request"
                         : e->status == 431 ? "Request Header Fields Too Large"
                         : e->status == 501 ? "Not Implemented"
                         : e->status == 503 ? "Service Unavailable"
                         : e->status == 505 ? "HTTP Version Not Supported"
                                            : "Error";
    char head[512];
    size_t bl = js ? strlen(js) : 0;
    int hl = snprintf(head, sizeof head,
                      "HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %zu\r\n%s%.200s%s"
                      "Connection: close\r\n\r\n",
                      e->status, reason, bl, replica ? "X-Cascade-Replica: " : "", replica ? replica : "",
                      replica ? "\r\n" : "");
    if (hl > 0 && hl < (int)sizeof head && send(fd, head, (size_t)hl, MSG_NOSIGNAL | MSG_DONTWAIT) == hl && js)
        (void)send(fd, js, bl, MSG_NOSIGNAL | MSG_DONTWAIT);
    free(js);
    shutdown(fd, SHUT_WR);
    char sink[4096];
    for (int k = 0; k < 64 && recv(fd, sink, sizeof sink, MSG_DONTWAIT) > 0; k++) {
    }
    close(fd);
}

static int same_host(const struct sockaddr_storage *a, const struct sockaddr_storage *b) {
    if (a->ss_family != b->ss_family) return 0;
    if (a->ss_family == AF_INET)
        return ((const struct sockaddr_in *)a)->sin_addr.s_addr == ((const struct sockaddr_in *)b)->sin_addr.s_addr;
    if (a->ss_family == AF_INET6)
        return !memcmp(&((const struct sockaddr_in6 *)a)->sin6_addr, &((const struct sockaddr_in6 *)b)->sin6_addr, 16);
    return 0;
}

static void drop(cas_srv_gate *g, int32_t i) {
    epoll_ctl(g->ep, EPOLL_CTL_DEL, g->pend[i].fd, NULL);
    memmove(g->pend + i, g->pend + i + 1, sizeof(gate_conn) * (size_t)(g->n_pend - i - 1));
    g->n_pend--;
}

static void on_readable(cas_srv_gate *g, int32_t i) {
    gate_conn c = g->pend[i];
    ssize_t n = recv(c.fd, g->buf, g->o.max_header_bytes + 1, MSG_PEEK | MSG_DONTWAIT);
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) return;
    if (n <= 0) { /* closed before its request, or an error */
        drop(g, i);
        close(c.fd);
        return;
    }
    cas_srv_error e;
    int r = cas_srv_head_check(g->buf, (size_t)n, g->o.max_header_bytes, &e);
    if (r == 0) return; /* more to come */
    drop(g, i);
    if (r < 0) {
        g->o.event(g->o.ctx, CAS_SRV_GATE_BAD, e.status);
        answer_close(c.fd, &e, g->o.replica);
        return;
    }
    g->o.admit(g->o.ctx, c.fd, (const struct sockaddr *)&c.addr, (unsigned)c.alen);
}

static void on_accept(cas_srv_gate *g) {
    for (;;) {
        gate_conn c;
        c.alen = sizeof c.addr;
        c.fd = accept4(g->o.listen_fd, (struct sockaddr *)&c.addr, &c.alen, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (c.fd < 0) return; /* EAGAIN, or an error the next event retries */
        c.since = cas_now_s();
        cas_srv_error e;
        if (g->o.per_ip > 0) {
            int32_t same = 0;
            for (int32_t k = 0; k < g->n_pend; k++) same += same_host(&g->pend[k].addr, &c.addr);
            if (same >= g->o.per_ip) {
                cas_srv_error_set(&e, 503, "server_error", "too_many_connections", NULL,
                                  "Too many connections from this address (limit %d)", (int)g->o.per_ip);
                g->o.event(g->o.ctx, CAS_SRV_GATE_REFUSED, 503);
                answer_close(c.fd, &e, g->o.replica);
                continue;
            }
        }
        /* near the total: the oldest connection still waiting for its head makes room */
        int64_t open = g->o.open_conns(g->o.ctx);
        if (open + g->n_pend >= g->o.max_conns - g->o.headroom && g->n_pend > 0) {
            int fd0 = g->pend[0].fd;
            drop(g, 0);
            close(fd0);
            g->o.event(g->o.ctx, CAS_SRV_GATE_EVICTED, 0);
        }
        if (open + g->n_pend >= g->o.max_conns || g->n_pend >= g->cap_pend) {
            cas_srv_error_set(&e, 503, "server_error", "too_many_connections", NULL,
                              "The server is at its connection limit (%d); retry later", (int)g->o.max_conns);
            g->o.event(g->o.ctx, CAS_SRV_GATE_REFUSED, 503);
            answer_close(c.fd, &e, g->o.replica);
            continue;
        }
        struct epoll_event ev;
        memset(&ev, 0, sizeof ev);
        ev.events = EPOLLIN | EPOLLRDHUP | EPOLLET;
        ev.data.fd = c.fd;
        if (epoll_ctl(g->ep, EPOLL_CTL_ADD, c.fd, &ev)) {
            close(c.fd);
            continue;
        }
        g->pend[g->n_pend++] = c;
        on_readable(g, g->n_pend - 1); /* the head may have come with the connection */
    }
}

static void *gate_main(void *arg) {
    cas_srv_gate *g = arg;
    struct epoll_event evs[64];
    while (!atomic_load(&g->stop)) {
        int n = epoll_wait(g->ep, evs, 64, 50);
        for (int i = 0; i < n; i++) {
            if (evs[i].data.fd == g->o.listen_fd) {
                on_accept(g);
                continue;
            }
            for (int32_t k = 0; k < g->n_pend; k++)
                if (g->pend[k].fd == evs[i].data.fd) {
                    on_readable(g, k);
                    break;
                }
        }
        if (g->o.header_timeout > 0) { /* a hard deadline for the head, as for kept-alive connections */
            double now = cas_now_s();
            while (g->n_pend > 0 && now - g->pend[0].since > g->o.header_timeout) {
                int fd0 = g->pend[0].fd;
                drop(g, 0);
                close(fd0);
                g->o.event(g->o.ctx, CAS_SRV_GATE_TIMEOUT, 0);
            }
        }
    }
    for (int32_t k = 0; k < g->n_pend; k++) close(g->pend[k].fd);
    g->n_pend = 0;
    return NULL;
}

cas_status cas_srv_gate_start(cas_srv_gate **out, const cas_srv_gate_opts *o) {
    *out = NULL;
    cas_srv_gate *g = calloc(1, sizeof *g);
    if (!g) return cas_error(CAS_ERR_NOMEM, "server: out of memory (gate)");
    g->o = *o;
    g->cap_pend = o->max_conns > 0 ? o->max_conns : 1;
    g->pend = calloc((size_t)g->cap_pend, sizeof(gate_conn));
    g->buf = malloc(o->max_header_bytes + 1);
    g->ep = epoll_create1(EPOLL_CLOEXEC);
    struct epoll_event ev;
    memset(&ev, 0, sizeof ev);
    ev.events = EPOLLIN;
    ev.data.fd = o->listen_fd;
    if (!g->pend || !g->buf || g->ep < 0 || epoll_ctl(g->ep, EPOLL_CTL_ADD, o->listen_fd, &ev)) {
        int e = errno;
        if (g->ep >= 0) close(g->ep);
        free(g->pend), free(g->buf), free(g);
        return cas_error(CAS_ERR_IO, "server: cannot set up the connection gate (%s)", strerror(e));
    }
    atomic_init(&g->stop, 0);
    if (pthread_create(&g->thread, NULL, gate_main, g)) {
        close(g->ep);
        free(g->pend), free(g->buf), free(g);
        return cas_error(CAS_ERR_IO, "server: cannot start a thread");
    }
    *out = g;
    return CAS_OK;
}

void cas_srv_gate_stop(cas_srv_gate *g) {
    if (!g) return;
    atomic_store(&g->stop, 1);
    pthread_join(g->thread, NULL);
    close(g->ep);
    free(g->pend);
    free(g->buf);
    free(g);
}
