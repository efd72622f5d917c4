/*
 * agents.fast._fastpath: the per-packet work of the user-space RoCEv2 transport, in C.
 *
 * What is here (and nothing else): building a run of consecutive RC data packets of one
 * work request (BTH [+ RETH] [+ ImmDt] + payload + pad + ICRC) with the pacer's arithmetic,
 * sending them with one sendmmsg, and receiving a batch of datagrams with one recvmmsg,
 * each parsed (BTH, RETH, AETH, ImmDt) and ICRC-checked exactly as
 * agents/wire/roce.py parse_packet does. The protocol state machines stay in Python
 * (agents/rdma/qp.py, agents/rdma/cc.py): Python decides what may go and this module
 * only does the byte work, so the Python path remains the reference
 * (tests/unit/test_fastpath*.py hold the two equal, byte for byte).
 *
 * A plain CPython extension, not cffi: no new dependency (clang and Python.h, from apt),
 * the buffer protocol hands over message buffers and memory regions without copies,
 * and there is no foreign-call layer between the interpreter and the batch (a cffi call
 * and its argument conversion would cost about what one packet's Python did).
 *
 * Floating point: the pacer's arithmetic is done in doubles in the same order as
 * agents/rdma/qp.py RatePacer.sent; built with -ffp-contract=off so no FMA changes a
 * rounding.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <netinet/in.h>
#include <arpa/inet.h>
#include <string.h>
#include <sys/socket.h>
#include <zlib.h>
#if defined(__x86_64__)
#include <cpuid.h>
#include <immintrin.h>
#endif

#define MAX_BATCH 64
#define HDR_MAX 32              /* BTH 12 + RETH 16 + ImmDt 4 */
#define TRAILER_MAX 8           /* pad 3 + ICRC 4 */
#define RX_SLOT_BYTES 65536     /* any UDP datagram fits: never truncated */
#define PSN_MASK 0xFFFFFFu

/* MalformedReason values (agents/wire/roce.py) */
enum { RSN_OK = 0, R_TOO_SHORT = 1, R_BAD_ICRC = 2, R_BAD_TVER = 3, R_UNKNOWN_OPCODE = 4,
       R_BAD_LENGTH = 5, R_BAD_PAD_COUNT = 6, R_RESERVED_SYNDROME = 7 };

static inline void put16(unsigned char *p, unsigned v) { p[0] = v >> 8; p[1] = v; }
static inline void put32(unsigned char *p, uint32_t v) {
    p[0] = v >> 24; p[1] = v >> 16; p[2] = v >> 8; p[3] = v;
}
static inline void put64(unsigned char *p, uint64_t v) { put32(p, v >> 32); put32(p + 4, (uint32_t)v); }
static inline uint32_t get32(const unsigned char *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}
static inline uint64_t get64(const unsigned char *p) { return (uint64_t)get32(p) << 32 | get32(p + 4); }

/* ------------------------------------------------------------------ CRC-32
 *
 * The ICRC is the standard CRC-32 (zlib's crc32). zlib 1.2 computes it a few bytes at a
 * time, ~1.3 us for a 4 KB packet on this class of machine; with PCLMULQDQ the same CRC
 * folds 64 bytes per step (the method of Intel's "Fast CRC Computation for Generic
 * Polynomials Using PCLMULQDQ", as Chromium's zlib and Linux's crc32-pclmul do it), about
 * ten times faster. The tail that does not fill 16 bytes, and any CPU without PCLMULQDQ,
 * goes to zlib. tests/unit/test_fastpath.py checks it against zlib.crc32.
 */
static int have_pclmul;

#if defined(__x86_64__)
__attribute__((target("pclmul,sse4.1")))
static uint32_t crc32_fold(const unsigned char *buf, size_t len, uint32_t crc) {
    /* len >= 64, a multiple of 16; crc pre- and post-inverted by the caller */
    static const uint64_t __attribute__((aligned(16))) k1k2[] = {0x0154442bd4, 0x01c6e41596};
    static const uint64_t __attribute__((aligned(16))) k3k4[] = {0x01751997d0, 0x00ccaa009e};
    static const uint64_t __attribute__((aligned(16))) k5k0[] = {0x0163cd6124, 0x0000000000};
    static const uint64_t __attribute__((aligned(16))) poly[] = {0x01db710641, 0x01f7011641};
    __m128i x0, x1, x2, x3, x4, x5, x6, x7, x8, y5, y6, y7, y8;
    x1 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
    x2 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
    x3 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
    x4 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
    x1 = _mm_xor_si128(x1, _mm_cvtsi32_si128((int)crc));
    x0 = _mm_load_si128((const __m128i *)k1k2);
    buf += 64;
    len -= 64;
    while (len >= 64) {
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x6 = _mm_clmulepi64_si128(x2, x0, 0x00);
        x7 = _mm_clmulepi64_si128(x3, x0, 0x00);
        x8 = _mm_clmulepi64_si128(x4, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x2 = _mm_clmulepi64_si128(x2, x0, 0x11);
        x3 = _mm_clmulepi64_si128(x3, x0, 0x11);
        x4 = _mm_clmulepi64_si128(x4, x0, 0x11);
        y5 = _mm_loadu_si128((const __m128i *)(buf + 0x00));
        y6 = _mm_loadu_si128((const __m128i *)(buf + 0x10));
        y7 = _mm_loadu_si128((const __m128i *)(buf + 0x20));
        y8 = _mm_loadu_si128((const __m128i *)(buf + 0x30));
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x5), y5);
        x2 = _mm_xor_si128(_mm_xor_si128(x2, x6), y6);
        x3 = _mm_xor_si128(_mm_xor_si128(x3, x7), y7);
        x4 = _mm_xor_si128(_mm_xor_si128(x4, x8), y8);
        buf += 64;
        len -= 64;
    }
    x0 = _mm_load_si128((const __m128i *)k3k4);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x3), x5);
    x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
    x1 = _mm_xor_si128(_mm_xor_si128(x1, x4), x5);
    while (len >= 16) {
        x2 = _mm_loadu_si128((const __m128i *)buf);
        x5 = _mm_clmulepi64_si128(x1, x0, 0x00);
        x1 = _mm_clmulepi64_si128(x1, x0, 0x11);
        x1 = _mm_xor_si128(_mm_xor_si128(x1, x2), x5);
        buf += 16;
        len -= 16;
    }
    /* 128 -> 64 bits */
    x2 = _mm_clmulepi64_si128(x1, x0, 0x10);
    x3 = _mm_setr_epi32(~0, 0, ~0, 0);
    x1 = _mm_srli_si128(x1, 8);
    x1 = _mm_xor_si128(x1, x2);
    x0 = _mm_loadl_epi64((const __m128i *)k5k0);
    x2 = _mm_srli_si128(x1, 4);
    x1 = _mm_and_si128(x1, x3);
    x1 = _mm_clmulepi64_si128(x1, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    /* Barrett reduction to 32 bits */
    x0 = _mm_load_si128((const __m128i *)poly);
    x2 = _mm_and_si128(x1, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x10);
    x2 = _mm_and_si128(x2, x3);
    x2 = _mm_clmulepi64_si128(x2, x0, 0x00);
    x1 = _mm_xor_si128(x1, x2);
    return (uint32_t)_mm_extract_epi32(x1, 1);
}

static void detect_pclmul(void) {
    unsigned a, b, c, d;
    if (__get_cpuid(1, &a, &b, &c, &d))
        have_pclmul = (c & bit_PCLMUL) && (c & bit_SSE4_1);
}
#else
static void detect_pclmul(void) { have_pclmul = 0; }
#endif

/* zlib's crc32(crc, buf, len), faster on long buffers */
static uint32_t crc32_any(uint32_t crc, const unsigned char *buf, size_t len) {
#if defined(__x86_64__)
    if (have_pclmul && len >= 64) {
        size_t chunk = len & ~(size_t)15;
        crc = ~crc32_fold(buf, chunk, ~crc);
        buf += chunk;
        len -= chunk;
        if (!len)
            return crc;
    }
#endif
    return (uint32_t)crc32(crc, buf, (uInt)len);
}

static PyObject *py_crc32(PyObject *mod, PyObject *args) {
    Py_buffer data;
    unsigned int seed = 0;
    int simd = 1;
    if (!PyArg_ParseTuple(args, "y*|Ip", &data, &seed, &simd))
        return NULL;
    int saved = have_pclmul;
    if (!simd)
        have_pclmul = 0;
    uint32_t crc = crc32_any(seed, data.buf, (size_t)data.len);
    have_pclmul = saved;
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(crc);
}

/* ------------------------------------------------------------------ opcode layouts */

/* Per opcode: bit 0 known, 1 reth, 2 imm, 3 aeth, 4 cnp, 5 payload, 6 pad; header bytes. */
enum { L_KNOWN = 1, L_RETH = 2, L_IMM = 4, L_AETH = 8, L_CNP = 16, L_PAYLOAD = 32, L_PAD = 64 };
static unsigned char layout_flags[256];
static unsigned char layout_hdr[256];

static void init_layouts(void) {
    static const int known[] = {0x00, 0x01, 0x02, 0x04, 0x06, 0x07, 0x08, 0x09, 0x0A, 0x0B,
                                0x11, 0x20, 0x21, 0x22, 0x24, 0x26, 0x27, 0x28, 0x29, 0x2A,
                                0x2B, 0x80, 0x81};
    for (size_t k = 0; k < sizeof known / sizeof known[0]; k++) {
        int opcode = known[k], op = opcode & 0x1F;
        int reth = op == 0x06 || op == 0x0A || op == 0x0B;
        int imm = op == 0x09 || op == 0x0B;
        int aeth = op == 0x11;
        int cnp = opcode == 0x80 || opcode == 0x81;
        int payload = !(aeth || cnp);
        int pad = payload && (op == 0x02 || op == 0x04 || op == 0x08 || op == 0x09 ||
                              op == 0x0A || op == 0x0B);
        layout_flags[opcode] = L_KNOWN | (reth ? L_RETH : 0) | (imm ? L_IMM : 0) |
                               (aeth ? L_AETH : 0) | (cnp ? L_CNP : 0) |
                               (payload ? L_PAYLOAD : 0) | (pad ? L_PAD : 0);
        layout_hdr[opcode] = 12 + (reth ? 16 : 0) + (imm ? 4 : 0) + (aeth ? 4 : (cnp ? 16 : 0));
    }
}

/* ------------------------------------------------------------------ TxBatch */

typedef struct {
    PyObject_HEAD
    int n;                          /* packets built */
    int sent;                       /* of which sent */
    Py_buffer data;                 /* the work request's message, held while packets wait */
    int have_data;
    unsigned char hdr[MAX_BATCH][HDR_MAX];
    unsigned char trailer[MAX_BATCH][TRAILER_MAX];
    struct iovec iov[MAX_BATCH][3];
    struct mmsghdr msgs[MAX_BATCH];
    struct sockaddr_storage addr;
    socklen_t addrlen;
    /* the ICRC pseudo-header (8 x 0xFF + masked IP + UDP header), lengths patched per packet */
    unsigned char pseudo[64];
    Py_ssize_t pseudo_len;
    uint32_t seed_len;              /* the UDP payload length `seed` is for */
    uint32_t seed;
} TxBatch;

static void tx_release(TxBatch *self) {
    if (self->have_data) {
        PyBuffer_Release(&self->data);
        self->have_data = 0;
    }
    self->n = self->sent = 0;
}

static void TxBatch_dealloc(TxBatch *self) {
    tx_release(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static uint32_t tx_seed(TxBatch *self, uint32_t udp_len_with_icrc) {
    if (self->seed_len == udp_len_with_icrc)
        return self->seed;
    unsigned char *p = self->pseudo;
    if (self->pseudo_len == 36) {               /* IPv4 */
        put16(p + 8 + 2, 20 + 8 + udp_len_with_icrc);
        put16(p + 8 + 20 + 4, 8 + udp_len_with_icrc);
    } else {                                    /* IPv6 */
        put16(p + 8 + 4, 8 + udp_len_with_icrc);
        put16(p + 8 + 40 + 4, 8 + udp_len_with_icrc);
    }
    self->seed = (uint32_t)crc32(0L, p, (uInt)self->pseudo_len);
    self->seed_len = udp_len_with_icrc;
    return self->seed;
}

PyDoc_STRVAR(tx_build_doc,
"build(data, first_idx, npkts, mtu, ops, dest_qp, p_key, psn, ack_req_every, reth, imm,\n"
"      pseudo, overhead, due_ns, rate_bps, burst_bits, now_ns, max_packets, budget_bytes)\n"
"-> (n, due_ns, udp_bytes, payload_bytes)\n\n"
"Build the packets poll_send would return one after another at `now_ns`, starting at\n"
"packet `first_idx` of a message of `npkts` packets (`data`: the whole message), at\n"
"most `max_packets`, stopping where the pacer says wait or before the packet that\n"
"would bring the wire bytes to `budget_bytes`. `ops` = (first, middle, last, only);\n"
"`reth` = (va, rkey, length) or None; `imm` = int or None; `pseudo` =\n"
"IcrcContext.pseudo_header(0). Any packets built earlier are dropped.");

static PyObject *TxBatch_build(TxBatch *self, PyObject *args) {
    Py_buffer data;
    Py_ssize_t first_idx, npkts, mtu, ack_req_every, max_packets;
    unsigned int op_first, op_middle, op_last, op_only, dest_qp, p_key, psn;
    PyObject *reth_obj, *imm_obj;
    Py_buffer pseudo;
    Py_ssize_t overhead;
    double due, rate, burst_bits, now, budget;
    if (!PyArg_ParseTuple(args, "y*nnn(IIII)IIInOOy*nddddnd", &data, &first_idx, &npkts, &mtu,
                          &op_first, &op_middle, &op_last, &op_only, &dest_qp, &p_key, &psn,
                          &ack_req_every, &reth_obj, &imm_obj, &pseudo, &overhead, &due, &rate,
                          &burst_bits, &now, &max_packets, &budget))
        return NULL;
    tx_release(self);
    self->data = data;
    self->have_data = 1;
    int with_reth = reth_obj != Py_None;
    unsigned long long va = 0;
    unsigned int rkey = 0, dma_len = 0;
    if (with_reth && !PyArg_ParseTuple(reth_obj, "KII", &va, &rkey, &dma_len)) {
        PyBuffer_Release(&pseudo);
        return NULL;
    }
    int with_imm = imm_obj != Py_None;
    unsigned long imm = 0;
    if (with_imm) {
        imm = PyLong_AsUnsignedLong(imm_obj);
        if (imm == (unsigned long)-1 && PyErr_Occurred()) {
            PyBuffer_Release(&pseudo);
            return NULL;
        }
    }
    if (pseudo.len != 36 && pseudo.len != 56) {
        PyBuffer_Release(&pseudo);
        PyErr_SetString(PyExc_ValueError, "pseudo-header must be 36 (IPv4) or 56 (IPv6) bytes");
        return NULL;
    }
    if (pseudo.len != self->pseudo_len || memcmp(pseudo.buf, self->pseudo, pseudo.len)) {
        memcpy(self->pseudo, pseudo.buf, pseudo.len);
        self->pseudo_len = pseudo.len;
        self->seed_len = 0;     /* lengths 0 in the template: recompute */
    }
    PyBuffer_Release(&pseudo);
    if (max_packets > MAX_BATCH)
        max_packets = MAX_BATCH;
    if (mtu <= 0 || ack_req_every <= 0 || first_idx < 0 || npkts <= first_idx) {
        PyErr_SetString(PyExc_ValueError, "bad segmentation arguments");
        return NULL;
    }
    const unsigned char *msg = data.buf;
    Py_ssize_t length = data.len;
    double wire_cum = 0;
    long long udp_total = 0, payload_total = 0;
    int k = 0;
    Py_ssize_t i = first_idx;
    while (k < max_packets && i < npkts) {
        if (now < due)
            break;
        int last = i == npkts - 1;
        unsigned opcode = i == 0 ? (last ? op_only : op_first) : (last ? op_last : op_middle);
        Py_ssize_t off = i * mtu;
        Py_ssize_t n = length - off;
        if (n > mtu)
            n = mtu;
        if (n < 0)
            n = 0;
        int pad = (int)(-n & 3);
        int has_reth = i == 0 && with_reth;
        int has_imm = last && with_imm;
        Py_ssize_t hl = 12 + (has_reth ? 16 : 0) + (has_imm ? 4 : 0);
        Py_ssize_t udp = hl + n + pad + 4;
        double wire = (double)(udp + overhead);
        if (wire_cum + wire >= budget)
            break;
        unsigned char *h = self->hdr[k];
        int ack_req = last || (psn % (unsigned)ack_req_every) == 0;
        h[0] = opcode;
        h[1] = pad << 4;
        put16(h + 2, p_key);
        put32(h + 4, 0xFF000000u | dest_qp);        /* byte 4 is 0xFF under the ICRC */
        put32(h + 8, (ack_req ? 0x80000000u : 0) | psn);
        if (has_reth) {
            put64(h + 12, va);
            put32(h + 20, rkey);
            put32(h + 24, dma_len);
        }
        if (has_imm)
            put32(h + hl - 4, (uint32_t)imm);
        unsigned char *t = self->trailer[k];
        memset(t, 0, 4);
        uint32_t crc = tx_seed(self, (uint32_t)udp);
        crc = (uint32_t)crc32(crc, h, (uInt)hl);
        if (n)
            crc = crc32_any(crc, msg + off, (size_t)n);
        if (pad)
            crc = (uint32_t)crc32(crc, t, (uInt)pad);
        h[4] = 0;
        t[pad] = crc; t[pad + 1] = crc >> 8; t[pad + 2] = crc >> 16; t[pad + 3] = crc >> 24;
        struct iovec *v = self->iov[k];
        v[0].iov_base = h; v[0].iov_len = hl;
        v[1].iov_base = (void *)(msg + off); v[1].iov_len = n;
        v[2].iov_base = t; v[2].iov_len = pad + 4;
        /* RatePacer.sent, operation for operation */
        double base = due;
        double floor = now - burst_bits * 1e9 / rate;
        if (base < floor)
            base = floor;
        due = base + (double)(udp + overhead) * 8e9 / rate;
        wire_cum += wire;
        udp_total += udp;
        payload_total += n;
        psn = (psn + 1) & PSN_MASK;
        k++;
        i++;
    }
    self->n = k;
    self->sent = 0;
    if (k == 0)
        tx_release(self);
    return Py_BuildValue("(idLL)", k, due, udp_total, payload_total);
}

static int tx_set_addr(TxBatch *self, PyObject *addr) {
    const char *host;
    int port;
    if (!PyArg_ParseTuple(addr, "si", &host, &port))
        return -1;
    memset(&self->addr, 0, sizeof self->addr);
    struct sockaddr_in *a4 = (struct sockaddr_in *)&self->addr;
    struct sockaddr_in6 *a6 = (struct sockaddr_in6 *)&self->addr;
    if (inet_pton(AF_INET, host, &a4->sin_addr) == 1) {
        a4->sin_family = AF_INET;
        a4->sin_port = htons(port);
        self->addrlen = sizeof *a4;
    } else if (inet_pton(AF_INET6, host, &a6->sin6_addr) == 1) {
        a6->sin6_family = AF_INET6;
        a6->sin6_port = htons(port);
        self->addrlen = sizeof *a6;
    } else {
        PyErr_Format(PyExc_ValueError, "not an IP address: %s", host);
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(tx_send_doc,
"send(fd, addr) -> (sent, errno)\n\n"
"sendmmsg the built packets not sent yet to addr = (ip, port). Returns how many went in\n"
"this call and the errno of the first that did not (0: all went). Call again to retry\n"
"the rest; the message buffer is held until all went or `clear()`.");

static PyObject *TxBatch_send(TxBatch *self, PyObject *args) {
    int fd;
    PyObject *addr;
    if (!PyArg_ParseTuple(args, "iO", &fd, &addr))
        return NULL;
    if (tx_set_addr(self, addr) < 0)
        return NULL;
    int before = self->sent, err = 0;
    while (self->sent < self->n) {
        int rest = self->n - self->sent;
        for (int j = 0; j < rest; j++) {
            struct msghdr *m = &self->msgs[j].msg_hdr;
            memset(m, 0, sizeof *m);
            m->msg_name = &self->addr;
            m->msg_namelen = self->addrlen;
            m->msg_iov = self->iov[self->sent + j];
            m->msg_iovlen = 3;
        }
        int r;
        Py_BEGIN_ALLOW_THREADS
        r = sendmmsg(fd, self->msgs, rest, 0);
        Py_END_ALLOW_THREADS
        if (r < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0)
                    return NULL;
                continue;
            }
            err = errno;
            break;
        }
        self->sent += r;
    }
    int went = self->sent - before;
    if (self->sent == self->n)
        tx_release(self);
    return Py_BuildValue("(ii)", went, err);
}

static PyObject *TxBatch_packet(TxBatch *self, PyObject *arg) {
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    if (k < 0 || k >= self->n) {
        PyErr_SetString(PyExc_IndexError, "no such built packet");
        return NULL;
    }
    struct iovec *v = self->iov[k];
    PyObject *out = PyBytes_FromStringAndSize(NULL, v[0].iov_len + v[1].iov_len + v[2].iov_len);
    if (!out)
        return NULL;
    char *p = PyBytes_AS_STRING(out);
    for (int j = 0; j < 3; j++) {
        memcpy(p, v[j].iov_base, v[j].iov_len);
        p += v[j].iov_len;
    }
    return out;
}

static PyObject *TxBatch_clear(TxBatch *self, PyObject *Py_UNUSED(ignored)) {
    tx_release(self);
    Py_RETURN_NONE;
}

static PyObject *TxBatch_pending(TxBatch *self, void *Py_UNUSED(closure)) {
    return PyLong_FromLong(self->n - self->sent);
}

static PyMethodDef TxBatch_methods[] = {
    {"build", (PyCFunction)TxBatch_build, METH_VARARGS, tx_build_doc},
    {"send", (PyCFunction)TxBatch_send, METH_VARARGS, tx_send_doc},
    {"packet", (PyCFunction)TxBatch_packet, METH_O,
     "packet(k) -> bytes: the k-th built packet as it goes on the wire (tests)."},
    {"clear", (PyCFunction)TxBatch_clear, METH_NOARGS,
     "clear(): drop the built packets not sent yet and let go of the message buffer."},
    {NULL}
};

static PyGetSetDef TxBatch_getset[] = {
    {"pending", (getter)TxBatch_pending, NULL, "built packets not sent yet", NULL},
    {NULL}
};

static PyTypeObject TxBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agents.fast._fastpath.TxBatch",
    .tp_doc = PyDoc_STR("Up to MAX_BATCH consecutive data packets of one QP, built and sent "
                        "together."),
    .tp_basicsize = sizeof(TxBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_dealloc = (destructor)TxBatch_dealloc,
    .tp_methods = TxBatch_methods,
    .tp_getset = TxBatch_getset,
};

/* ------------------------------------------------------------------ RxBatch */

typedef struct {
    PyObject_HEAD
    int slots;
    unsigned char *bufs;                /* slots x RX_SLOT_BYTES, the storage of buf_obj */
    /* The receive slots are a bytearray, and every payload handed out is a slice of one
     * read-only memoryview of it: a view kept past the next receive sees newer bytes (as
     * the Python path's reused buffer does), but one kept past this object never points
     * at freed memory, since the slices hold the bytearray. */
    PyObject *buf_obj, *buf_view;
    struct mmsghdr *msgs;
    struct iovec *iov;
    struct sockaddr_in *names;
    unsigned char *ctl;                 /* slots x CTL_BYTES */
    unsigned char local_ip[4];
    unsigned local_port;
    PyObject *parsed_t, *bth_t, *reth_t, *aeth_t;
    /* the last source address and its (ip, port) tuple: one peer sends most packets */
    struct sockaddr_in last_name;
    PyObject *last_addr;
} RxBatch;

/* The in-order RDMA WRITE MIDDLE run of one QP (`recv`'s `hot`): its responder's state,
 * advanced here packet by packet exactly as RcResponder.on_request would, for the packets
 * that change nothing else (no CE mark, no AckReq, no ACK due, a full MTU that leaves
 * bytes of the WRITE to come). */
typedef struct {
    int active;
    uint32_t qpn, epsn;
    struct in_addr peer_ip;
    uint16_t peer_port;                 /* network order */
    Py_ssize_t mtu, ack_every, since_ack, wr_off, wr_left;
    Py_buffer wr;
    long long count, udp_bytes, payload_bytes;
} hot_run;

#define CTL_BYTES 64

static void RxBatch_dealloc(RxBatch *self) {
    Py_XDECREF(self->buf_view);
    Py_XDECREF(self->buf_obj);
    PyMem_RawFree(self->msgs);
    PyMem_RawFree(self->iov);
    PyMem_RawFree(self->names);
    PyMem_RawFree(self->ctl);
    Py_XDECREF(self->parsed_t);
    Py_XDECREF(self->bth_t);
    Py_XDECREF(self->reth_t);
    Py_XDECREF(self->aeth_t);
    Py_XDECREF(self->last_addr);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int RxBatch_init(RxBatch *self, PyObject *args, PyObject *kwds) {
    int slots;
    const char *local_ip;
    int local_port;
    PyObject *parsed_t, *bth_t, *reth_t, *aeth_t;
    static char *kwlist[] = {"slots", "local_ip", "local_port", "parsed", "bth", "reth", "aeth",
                             NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "isiOOOO", kwlist, &slots, &local_ip,
                                     &local_port, &parsed_t, &bth_t, &reth_t, &aeth_t))
        return -1;
    if (slots < 1 || slots > 1024) {
        PyErr_SetString(PyExc_ValueError, "slots must be 1..1024");
        return -1;
    }
    if (inet_pton(AF_INET, local_ip, self->local_ip) != 1) {
        PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", local_ip);
        return -1;
    }
    if (self->bufs) {
        PyErr_SetString(PyExc_RuntimeError, "RxBatch initialised twice");
        return -1;
    }
    self->local_port = local_port;
    self->slots = slots;
    /* large and mostly untouched: only the pages datagrams land in become resident */
    /* bytearray(NULL, n) leaves the storage untouched: pages become resident as used */
    self->buf_obj = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)slots * RX_SLOT_BYTES);
    if (!self->buf_obj)
        return -1;
    PyObject *view = PyMemoryView_FromObject(self->buf_obj);
    if (!view)
        return -1;
    self->buf_view = PyObject_CallMethod(view, "toreadonly", NULL);
    Py_DECREF(view);
    if (!self->buf_view)
        return -1;
    self->bufs = (unsigned char *)PyByteArray_AS_STRING(self->buf_obj);
    self->msgs = PyMem_RawCalloc(slots, sizeof *self->msgs);
    self->iov = PyMem_RawCalloc(slots, sizeof *self->iov);
    self->names = PyMem_RawCalloc(slots, sizeof *self->names);
    self->ctl = PyMem_RawCalloc(slots, CTL_BYTES);
    if (!self->bufs || !self->msgs || !self->iov || !self->names || !self->ctl) {
        PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(parsed_t); self->parsed_t = parsed_t;
    Py_INCREF(bth_t); self->bth_t = bth_t;
    Py_INCREF(reth_t); self->reth_t = reth_t;
    Py_INCREF(aeth_t); self->aeth_t = aeth_t;
    return 0;
}

/* A tuple subclass instance (a NamedTuple) from `n` new references, as tuple.__new__ makes. */
static PyObject *named(PyObject *type, Py_ssize_t n, PyObject **items) {
    PyTypeObject *tp = (PyTypeObject *)type;
    PyObject *t = tp->tp_alloc(tp, n);
    if (!t) {
        for (Py_ssize_t j = 0; j < n; j++)
            Py_XDECREF(items[j]);
        return NULL;
    }
    for (Py_ssize_t j = 0; j < n; j++) {
        if (!items[j]) {
            for (Py_ssize_t q = j; q < n; q++)
                Py_XDECREF(items[q]);
            Py_DECREF(t);
            return NULL;
        }
        PyTuple_SET_ITEM(t, j, items[j]);
    }
    return t;
}

static inline PyObject *pybool(int v) { PyObject *o = v ? Py_True : Py_False; Py_INCREF(o); return o; }

/* parse_packet's checks, in its order. Returns a MalformedReason, or 0 with the fields. */
typedef struct {
    unsigned opcode, flags, p_key, pad;
    uint32_t w1, w2;
    Py_ssize_t hdr, size;
    uint32_t stored;
    unsigned char lf;
} rx_fields;

static int rx_parse(RxBatch *self, const unsigned char *d, Py_ssize_t n,
                    const struct sockaddr_in *src, rx_fields *f) {
    if (n < 16)
        return R_TOO_SHORT;
    Py_ssize_t end = n - 4;
    f->stored = (uint32_t)d[end] | (uint32_t)d[end + 1] << 8 | (uint32_t)d[end + 2] << 16 |
                (uint32_t)d[end + 3] << 24;
    if (n > 0xFFFF - 8 - 20)
        return R_BAD_LENGTH;          /* IcrcContext.seed refuses it (never on IPv4 UDP) */
    unsigned char ph[36];
    memset(ph, 0xFF, 8);
    unsigned char *ip = ph + 8;
    ip[0] = 0x45; ip[1] = 0xFF; put16(ip + 2, 20 + 8 + n); put16(ip + 4, 0);
    put16(ip + 6, 0x4000); ip[8] = 0xFF; ip[9] = 17; put16(ip + 10, 0xFFFF);
    memcpy(ip + 12, &src->sin_addr, 4);
    memcpy(ip + 16, self->local_ip, 4);
    unsigned char *udp = ph + 28;
    memcpy(udp, &src->sin_port, 2);
    put16(udp + 2, self->local_port);
    put16(udp + 4, 8 + n);
    put16(udp + 6, 0xFFFF);
    uint32_t crc = (uint32_t)crc32(0L, ph, 36);
    crc = (uint32_t)crc32(crc, d, 4);
    static const unsigned char ff = 0xFF;
    crc = (uint32_t)crc32(crc, &ff, 1);
    crc = crc32_any(crc, d + 5, (size_t)(end - 5));
    if (crc != f->stored)
        return R_BAD_ICRC;
    f->opcode = d[0];
    f->flags = d[1];
    f->p_key = (unsigned)d[2] << 8 | d[3];
    f->w1 = get32(d + 4);
    f->w2 = get32(d + 8);
    if (f->flags & 0x0F)
        return R_BAD_TVER;
    unsigned char lf = layout_flags[f->opcode];
    if (!(lf & L_KNOWN))
        return R_UNKNOWN_OPCODE;
    f->lf = lf;
    f->pad = (f->flags >> 4) & 3;
    Py_ssize_t hdr = layout_hdr[f->opcode];
    f->hdr = hdr;
    if (end < hdr)
        return R_TOO_SHORT;
    if (n & 3)
        return R_BAD_LENGTH;
    if (lf & L_PAYLOAD) {
        Py_ssize_t size = end - hdr - f->pad;
        if (f->pad && (size < 0 || !(lf & L_PAD)))
            return R_BAD_PAD_COUNT;
        f->size = size;
    } else {
        if (end != hdr)
            return R_BAD_LENGTH;
        if (f->pad)
            return R_BAD_PAD_COUNT;
        f->size = 0;
    }
    if (lf & L_AETH) {
        unsigned syndrome = d[12];
        if (syndrome & 0x80 || (syndrome >> 5) == 2)
            return R_RESERVED_SYNDROME;
    }
    return RSN_OK;
}

static PyObject *rx_parsed(RxBatch *self, unsigned char *d, const rx_fields *f) {
    PyObject *b[11] = {
        PyLong_FromUnsignedLong(f->opcode), pybool(f->flags & 0x80), pybool(f->flags & 0x40),
        PyLong_FromUnsignedLong(f->pad), PyLong_FromLong(0), PyLong_FromUnsignedLong(f->p_key),
        pybool(f->w1 & 0x80000000u), pybool(f->w1 & 0x40000000u),
        PyLong_FromUnsignedLong(f->w1 & 0xFFFFFF), pybool(f->w2 & 0x80000000u),
        PyLong_FromUnsignedLong(f->w2 & 0xFFFFFF)};
    PyObject *bth = named(self->bth_t, 11, b);
    if (!bth)
        return NULL;
    PyObject *reth = Py_None, *aeth = Py_None, *imm = Py_None;
    Py_INCREF(Py_None); Py_INCREF(Py_None); Py_INCREF(Py_None);
    if (f->lf & L_RETH) {
        PyObject *r[3] = {PyLong_FromUnsignedLongLong(get64(d + 12)),
                          PyLong_FromUnsignedLong(get32(d + 20)),
                          PyLong_FromUnsignedLong(get32(d + 24))};
        Py_DECREF(reth);
        reth = named(self->reth_t, 3, r);
    }
    if (f->lf & L_IMM) {
        Py_DECREF(imm);
        imm = PyLong_FromUnsignedLong(get32(d + f->hdr - 4));
    } else if (f->lf & L_AETH) {
        uint32_t word = get32(d + 12);
        PyObject *a[2] = {PyLong_FromUnsignedLong(word >> 24),
                          PyLong_FromUnsignedLong(word & 0xFFFFFF)};
        Py_DECREF(aeth);
        aeth = named(self->aeth_t, 2, a);
    }
    Py_ssize_t start = (Py_ssize_t)(d - self->bufs) + (Py_ssize_t)f->hdr;
    PyObject *payload = PySequence_GetSlice(self->buf_view, start, start + (Py_ssize_t)f->size);
    PyObject *p[6] = {bth, reth, aeth, payload, PyLong_FromUnsignedLong(f->stored), imm};
    return named(self->parsed_t, 6, p);
}

/* Emit the run so far as one result: (0, packets, udp_bytes, payload_bytes), or -1 first
 * when its last packet is due an ACK (AckReq, or ack_every packets since the last). */
static int hot_flush(hot_run *h, PyObject *results, int ack) {
    if (!h->count)
        return 0;
    PyObject *item = Py_BuildValue("(iLLL)", ack ? -1 : 0, h->count, h->udp_bytes,
                                   h->payload_bytes);
    if (!item)
        return -1;
    int rc = PyList_Append(results, item);
    Py_DECREF(item);
    h->count = h->udp_bytes = h->payload_bytes = 0;
    return rc;
}

PyDoc_STRVAR(rx_recv_doc,
"recv(fd, budget, hot=None) -> (results, errors, overflow)\n\n"
"recvmmsg up to `budget` datagrams (MSG_DONTWAIT), each parsed and ICRC-checked as\n"
"parse_packet does for its source address -> (local_ip, local_port). `results` is a list\n"
"of (parsed_or_reason, ce, addr, nbytes): a Parsed, or the int MalformedReason value the\n"
"Python path would count; `ce` is the IP_TOS control message's CE mark. `errors` counts\n"
"failed receives other than EAGAIN; `overflow` is the last SO_RXQ_OVFL value seen, or -1.\n"
"Payload views point into this batch's buffers: valid until the next recv.\n"
"`hot` = (qpn, peer_ip, peer_port, expected_psn, mtu, ack_every, since_ack, write_view,\n"
"write_off, write_left) lets C take a QP's in-order WRITE MIDDLE packets itself (see\n"
"RcResponder.fast_hint): each run of them is one result (0, packets, udp_bytes,\n"
"payload_bytes), or (-1, ...) when its last packet is due an ACK, in its place among the\n"
"others; after the first packet for that QP that C does not take, the rest of the batch\n"
"goes to Python.");

static PyObject *RxBatch_recv(RxBatch *self, PyObject *args) {
    int fd, budget;
    PyObject *hot_obj = Py_None;
    if (!PyArg_ParseTuple(args, "ii|O", &fd, &budget, &hot_obj))
        return NULL;
    hot_run hot;
    memset(&hot, 0, sizeof hot);
    if (hot_obj != Py_None) {
        unsigned int qpn, epsn;
        const char *peer_ip;
        int peer_port;
        PyObject *view;
        if (!PyArg_ParseTuple(hot_obj, "IsiInnnOnn", &qpn, &peer_ip, &peer_port, &epsn,
                              &hot.mtu, &hot.ack_every, &hot.since_ack, &view, &hot.wr_off,
                              &hot.wr_left))
            return NULL;
        if (inet_pton(AF_INET, peer_ip, &hot.peer_ip) != 1) {
            PyErr_Format(PyExc_ValueError, "not an IPv4 address: %s", peer_ip);
            return NULL;
        }
        if (PyObject_GetBuffer(view, &hot.wr, PyBUF_WRITABLE) < 0)
            return NULL;
        if (hot.wr_off < 0 || hot.wr_left < 0 || hot.wr_off + hot.wr_left > hot.wr.len) {
            PyBuffer_Release(&hot.wr);
            PyErr_SetString(PyExc_ValueError, "the WRITE in progress does not fit its region");
            return NULL;
        }
        hot.qpn = qpn;
        hot.epsn = epsn;
        hot.peer_port = htons(peer_port);
        hot.active = 1;
    }
    PyObject *ret = NULL;
    PyObject *results = NULL;
    if (!self->bufs) {
        PyErr_SetString(PyExc_RuntimeError, "RxBatch not initialised");
        goto done;
    }
    if (budget > self->slots)
        budget = self->slots;
    results = PyList_New(0);
    if (!results)
        goto done;
    long errors = 0, overflow = -1;
    for (int j = 0; j < budget; j++) {
        self->iov[j].iov_base = self->bufs + (size_t)j * RX_SLOT_BYTES;
        self->iov[j].iov_len = RX_SLOT_BYTES;
        struct msghdr *m = &self->msgs[j].msg_hdr;
        m->msg_name = &self->names[j];
        m->msg_namelen = sizeof self->names[j];
        m->msg_iov = &self->iov[j];
        m->msg_iovlen = 1;
        m->msg_control = self->ctl + (size_t)j * CTL_BYTES;
        m->msg_controllen = CTL_BYTES;
        m->msg_flags = 0;
    }
    int r;
    for (;;) {
        r = recvmmsg(fd, self->msgs, budget, MSG_DONTWAIT, NULL);
        if (r >= 0)
            break;
        if (errno == EAGAIN || errno == EWOULDBLOCK)
            break;
        if (errno == EINTR) {
            if (PyErr_CheckSignals() < 0)
                goto fail;
            continue;
        }
        errors++;       /* the Python path counts one and tries again */
        if (errors >= budget)
            break;
    }
    for (int j = 0; j < r; j++) {
        struct msghdr *m = &self->msgs[j].msg_hdr;
        unsigned char *d = self->iov[j].iov_base;
        Py_ssize_t n = self->msgs[j].msg_len;
        int ce = 0;
        for (struct cmsghdr *c = CMSG_FIRSTHDR(m); c; c = CMSG_NXTHDR(m, c)) {
            if (c->cmsg_level == IPPROTO_IP && c->cmsg_type == IP_TOS &&
                c->cmsg_len > CMSG_LEN(0))
                ce = (CMSG_DATA(c)[0] & 3) == 3;
            else if (c->cmsg_level == SOL_SOCKET && c->cmsg_type == SO_RXQ_OVFL &&
                     c->cmsg_len >= CMSG_LEN(4)) {
                uint32_t v;
                memcpy(&v, CMSG_DATA(c), 4);
                overflow = v;
            }
        }
        struct sockaddr_in *src = &self->names[j];
        if (!self->last_addr || src->sin_addr.s_addr != self->last_name.sin_addr.s_addr ||
            src->sin_port != self->last_name.sin_port) {
            char host[INET_ADDRSTRLEN];
            inet_ntop(AF_INET, &src->sin_addr, host, sizeof host);
            PyObject *a = Py_BuildValue("(si)", host, ntohs(src->sin_port));
            if (!a)
                goto fail;
            Py_XSETREF(self->last_addr, a);
            self->last_name = *src;
        }
        rx_fields f;
        int reason = rx_parse(self, d, n, src, &f);
        if (!reason && hot.active && (f.w1 & 0xFFFFFF) == hot.qpn &&
            src->sin_addr.s_addr == hot.peer_ip.s_addr && src->sin_port == hot.peer_port) {
            /* RcQp.on_packet -> RcResponder.on_request for an in-order WRITE MIDDLE without
             * a CE mark: placed here; the ACK it may be due is Python's to send */
            if (f.opcode == 0x07 && !ce && (f.w2 & 0xFFFFFF) == hot.epsn &&
                f.size == hot.mtu && f.size < hot.wr_left) {
                memcpy((char *)hot.wr.buf + hot.wr_off, d + f.hdr, f.size);
                hot.wr_off += f.size;
                hot.wr_left -= f.size;
                hot.since_ack++;
                hot.epsn = (hot.epsn + 1) & PSN_MASK;
                hot.count++;
                hot.udp_bytes += n;
                hot.payload_bytes += f.size;
                if ((f.w2 & 0x80000000u) || hot.since_ack >= hot.ack_every) {
                    /* _accept sends an ACK here (and _send_ack zeroes the count) */
                    if (hot_flush(&hot, results, 1) < 0)
                        goto fail;
                    hot.since_ack = 0;
                }
                continue;
            }
            hot.active = 0;     /* Python takes this packet, and the QP, from here */
        }
        if (hot_flush(&hot, results, 0) < 0)
            goto fail;
        PyObject *what = reason ? PyLong_FromLong(reason) : rx_parsed(self, d, &f);
        if (!what)
            goto fail;
        PyObject *item = PyTuple_New(4);
        if (!item) {
            Py_DECREF(what);
            goto fail;
        }
        PyTuple_SET_ITEM(item, 0, what);
        PyTuple_SET_ITEM(item, 1, pybool(ce));
        Py_INCREF(self->last_addr);
        PyTuple_SET_ITEM(item, 2, self->last_addr);
        PyTuple_SET_ITEM(item, 3, PyLong_FromSsize_t(n));
        if (PyList_Append(results, item) < 0) {
            Py_DECREF(item);
            goto fail;
        }
        Py_DECREF(item);
    }
    if (hot_flush(&hot, results, 0) < 0)
        goto fail;
    ret = Py_BuildValue("(Nll)", results, errors, overflow);
    results = NULL;
    goto done;
fail:
    Py_CLEAR(results);
done:
    Py_XDECREF(results);
    if (hot.wr.obj)
        PyBuffer_Release(&hot.wr);
    return ret;
}

PyDoc_STRVAR(rx_parse_doc,
"parse(data, src_ip, src_port) -> Parsed or int\n\n"
"What recv does with one datagram from (src_ip, src_port): the Parsed packet, or the\n"
"MalformedReason value. The payload view points into a copy kept by this batch (slot 0).");

static PyObject *RxBatch_parse(RxBatch *self, PyObject *args) {
    Py_buffer data;
    const char *host;
    int port;
    if (!PyArg_ParseTuple(args, "y*si", &data, &host, &port))
        return NULL;
    struct sockaddr_in src;
    memset(&src, 0, sizeof src);
    if (inet_pton(AF_INET, host, &src.sin_addr) != 1 || data.len > RX_SLOT_BYTES) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_ValueError, "bad source address or datagram too long");
        return NULL;
    }
    src.sin_port = htons(port);
    memcpy(self->bufs, data.buf, data.len);
    Py_ssize_t n = data.len;
    PyBuffer_Release(&data);
    rx_fields f;
    int reason = rx_parse(self, self->bufs, n, &src, &f);
    return reason ? PyLong_FromLong(reason) : rx_parsed(self, self->bufs, &f);
}

static PyMethodDef RxBatch_methods[] = {
    {"recv", (PyCFunction)RxBatch_recv, METH_VARARGS, rx_recv_doc},
    {"parse", (PyCFunction)RxBatch_parse, METH_VARARGS, rx_parse_doc},
    {NULL}
};

static PyTypeObject RxBatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "agents.fast._fastpath.RxBatch",
    .tp_doc = PyDoc_STR("RxBatch(slots, local_ip, local_port, parsed, bth, reth, aeth): "
                        "recvmmsg + parse + ICRC check for one IPv4 endpoint."),
    .tp_basicsize = sizeof(RxBatch),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)RxBatch_init,
    .tp_dealloc = (destructor)RxBatch_dealloc,
    .tp_methods = RxBatch_methods,
};

/* ------------------------------------------------------------------ module */

static PyMethodDef module_methods[] = {
    {"crc32", py_crc32, METH_VARARGS,
     "crc32(data, seed=0, simd=True) -> int: zlib.crc32(data, seed), as the ICRC is computed "
     "here (simd=False: zlib's own; for tests)."},
    {NULL}
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "agents.fast._fastpath",
    "Batched build/send and receive/parse of RoCEv2 packets (see agents/fast/__init__.py).",
    -1, module_methods,
};

PyMODINIT_FUNC PyInit__fastpath(void) {
    init_layouts();
    detect_pclmul();
    if (PyType_Ready(&TxBatchType) < 0 || PyType_Ready(&RxBatchType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&TxBatchType);
    Py_INCREF(&RxBatchType);
    if (PyModule_AddObject(m, "TxBatch", (PyObject *)&TxBatchType) < 0 ||
        PyModule_AddObject(m, "RxBatch", (PyObject *)&RxBatchType) < 0 ||
        PyModule_AddIntConstant(m, "MAX_BATCH", MAX_BATCH) < 0 ||
        PyModule_AddIntConstant(m, "ABI", 1) < 0 ||
        PyModule_AddIntConstant(m, "PCLMUL", have_pclmul) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
