/* latency_router: a switch whose every hop takes DELAY_US microseconds, for the simulated test
 * hosts (tests/support/_hosts.py, hosts(..., latency_us=D)). The kernel here has no netem, so the
 * delay is added in userspace, where every library's traffic pays it alike.
 *
 *   latency_router [-p PRIORITY] [-s SPIN_US] [-q QUEUE_KIB] DELAY_US NAME=ADDR...
 *
 * For each NAME=ADDR it creates the TUN device NAME (IFF_TUN | IFF_NO_PI: bare IP packets) in its
 * own network namespace and keeps its fd in tun[i]; addr[i] is the host behind it. The caller then
 * moves each device into its host's namespace (the fd stays valid). "ready" on stdout says that
 * all devices exist.
 *
 * The algorithm: one global FIFO of packets, in the byte ring `ring` of `cap` bytes (QUEUE_KIB,
 * default 16 MiB). Every packet read from any tun[i] is stored in the ring as a record
 * {due, len, dst} followed by its bytes, with due = the CLOCK_MONOTONIC time it was read +
 * delay_ns and dst = the index whose addr[dst] is the packet's IPv4 destination. The delay being
 * the same for every packet, records fall due in the order they were read: the oldest record (at
 * `head`) is always the next to go, and flush() writes every record whose due time has come to
 * tun[dst].
 *
 * Between flushes the router sleeps in ppoll() on all fds until `early_ns` before the head
 * record's due time (no timeout when the ring is empty); from then on it polls without sleeping
 * (a timeout of 0: a spin that still reads arriving packets at once) until the record is due. A
 * timed wake-up comes tens of microseconds late on a virtual machine even with PR_SET_TIMERSLACK
 * at 1 ns, so early_ns is learnt: a moving average (weight 1/8) of how late the timed wake-ups
 * came, at most spin_max_ns (SPIN_US, default 100). The lateness of the wake-up itself uses up
 * most of that margin, so little time goes into spinning. late_ns_sum and late_ns_max say how late
 * writes began. With PRIORITY > 0 the router runs as SCHED_FIFO: busy hosts do not hold it up.
 *
 * Records never straddle the end of the ring: a packet is read straight into the ring at `tail`
 * only where a record of the largest size (REC_MAX) fits; when none fits before the end, the data's
 * end is kept in `wrap_at` and records go on at offset 0. When there is no room, the packet is
 * read into `scratch` and dropped (dropped_full), as a switch with full buffers would; so are
 * packets that are not IPv4 or are for no host (unroutable) and those from or to a host whose
 * cable is pulled (dropped_down).
 *
 * The forwarding cost: the router times each read() and write() of a packet (CLOCK_MONOTONIC
 * around the call; the router runs alone on its core under SCHED_FIFO, so that is its own work,
 * the receiving host's network stack included: a write() to a TUN device delivers the packet
 * into its host's stack in the writer's context). For reads and for writes apart it keeps the
 * sums a least-squares line t = a + b * len needs (count, len, t, len^2, len * t), so the test
 * harness can tell how long a packet of any size holds the one router thread up
 * (_latency.forwarding_cost; benchmarks/scale_model.py --validate models the switch with it).
 *
 * Control: stdin takes the lines "down I" and "up I" (pull or plug host I's cable: its device
 * loses or regains its carrier and its packets are dropped both ways) and "stats"; each gets one
 * line on stdout. EOF on stdin, SIGTERM, SIGINT or the death of the parent process end the
 * router; its TUN devices go with it.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/if.h>
#include <linux/if_tun.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define MAX_HOSTS 253
#define MAX_PKT 65536
#define BATCH 32 /* packets read from one device before the next device gets its turn */

struct rec { uint64_t due; uint32_t len; int32_t dst; unsigned char data[]; };
#define REC_SIZE(len) ((sizeof(struct rec) + (len) + 15) & ~(size_t)15)
#define REC_MAX REC_SIZE(MAX_PKT)

static int n, tun[MAX_HOSTS], down[MAX_HOSTS];
static uint32_t addr[MAX_HOSTS];
static uint64_t delay_ns, early_ns, spin_max_ns = 100000;
static unsigned char *ring, scratch[MAX_PKT];
static size_t cap, head, tail, wrap_at, queued;
static unsigned long long rx, tx, dropped_full, unroutable, dropped_down, write_errors;
static unsigned long long late_ns_sum, late_ns_max;
/* Per direction (0: read, 1: write): count, sum of len, of ns, of len^2 and of len * ns. */
static unsigned long long cost_n[2], cost_len[2], cost_ns[2], cost_len2[2], cost_len_ns[2];
static volatile sig_atomic_t stop;

static uint64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000u + (uint64_t)ts.tv_nsec;
}

static void on_signal(int sig) { (void)sig; stop = 1; }

static void die(const char *what) { perror(what); exit(1); }

static void stats(char *out, size_t size) {
    int used = snprintf(out, size, "rx %llu tx %llu dropped_full %llu unroutable %llu dropped_down %llu "
                        "write_errors %llu queued %zu late_ns_sum %llu late_ns_max %llu early_ns %llu",
                        rx, tx, dropped_full, unroutable, dropped_down, write_errors, queued, late_ns_sum,
                        late_ns_max, (unsigned long long)early_ns);
    for (int d = 0; d < 2 && used > 0 && (size_t)used < size; d++) {
        const char *w = d ? "write" : "read";
        used += snprintf(out + used, size - (size_t)used, " %s_n %llu %s_len %llu %s_ns %llu %s_len2 %llu "
                         "%s_len_ns %llu", w, cost_n[d], w, cost_len[d], w, cost_ns[d], w, cost_len2[d],
                         w, cost_len_ns[d]);
    }
    if (used > 0 && (size_t)used + 1 < size)
        out[used] = '\n', out[used + 1] = 0;
}

/* One packet of len bytes moved in ns (d 0: read, 1: write). */
static void cost(int d, uint64_t len, uint64_t ns) {
    cost_n[d]++, cost_len[d] += len, cost_ns[d] += ns, cost_len2[d] += len * len, cost_len_ns[d] += len * ns;
}

/* The ring's place for the next packet, or NULL when the ring is full. Unwrapped (wrap_at == cap)
 * the records lie in [head, tail); wrapped, in [head, wrap_at) and [0, tail). */
static struct rec *room(void) {
    if (queued == 0)
        head = tail = 0, wrap_at = cap;
    if (wrap_at == cap) {
        if (cap - tail >= REC_MAX)
            return (struct rec *)(ring + tail);
        if (head < REC_MAX)
            return NULL;
        wrap_at = tail, tail = 0; /* no room before the end: go on at the start */
    }
    return head - tail >= REC_MAX ? (struct rec *)(ring + tail) : NULL;
}

/* The index of the host a packet goes to, or -1. */
static int route(const unsigned char *p, ssize_t len) {
    if (len < 20 || p[0] >> 4 != 4)
        return -1;
    uint32_t dst;
    memcpy(&dst, p + 16, 4);
    for (int i = 0; i < n; i++)
        if (addr[i] == dst)
            return i;
    return -1;
}

/* Write every record whose due time has come. */
static void flush(void) {
    while (queued) {
        struct rec *r = (struct rec *)(ring + head);
        uint64_t now = now_ns();
        if (r->due > now)
            return;
        late_ns_sum += now - r->due;
        if (now - r->due > late_ns_max)
            late_ns_max = now - r->due;
        if (down[r->dst])
            dropped_down++;
        else if (write(tun[r->dst], r->data, r->len) == (ssize_t)r->len)
            tx++, cost(1, r->len, now_ns() - now);
        else
            write_errors++;
        head += REC_SIZE(r->len);
        if (--queued == 0)
            head = tail = 0, wrap_at = cap;
        else if (head == wrap_at)
            head = 0, wrap_at = cap;
    }
}

/* Read one packet from tun[i] (pfd) into the ring; 0 when there was none. */
static int receive(struct pollfd *pfd, int i) {
    struct rec *r = room();
    unsigned char *buf = r ? r->data : scratch;
    uint64_t start = now_ns();
    ssize_t len = read(pfd->fd, buf, MAX_PKT);
    if (len < 0) {
        if (errno != EAGAIN && errno != EINTR) {
            fprintf(stderr, "latency_router: device %d: %s; no longer read\n", i, strerror(errno));
            pfd->fd = -1;
        }
        return 0;
    }
    rx++;
    uint64_t read_at = now_ns();
    cost(0, (uint64_t)len, read_at - start);
    int dst = route(buf, len);
    if (!r)
        dropped_full++;
    else if (dst < 0)
        unroutable++;
    else if (down[i] || down[dst])
        dropped_down++;
    else {
        r->due = read_at + delay_ns, r->len = (uint32_t)len, r->dst = dst;
        tail += REC_SIZE(len);
        queued++;
    }
    return 1;
}

static void reply(const char *text) {
    if (write(1, text, strlen(text)) < 0)
        stop = 1;
}

/* Carry out the complete lines that came on stdin; 0 at EOF. */
static int control(void) {
    static char line[256];
    static size_t have;
    ssize_t got = read(0, line + have, sizeof line - 1 - have);
    if (got <= 0)
        return got < 0 && (errno == EAGAIN || errno == EINTR);
    have += (size_t)got;
    char *nl, out[1024];
    while ((nl = memchr(line, '\n', have))) {
        *nl = 0;
        int i = -1, on = -1;
        if (sscanf(line, "up %d", &i) == 1)
            on = 1;
        else if (sscanf(line, "down %d", &i) == 1)
            on = 0;
        snprintf(out, sizeof out, "ok\n");
        if (!strcmp(line, "stats"))
            stats(out, sizeof out);
        else if (on < 0)
            snprintf(out, sizeof out, "error: expected 'up I', 'down I' or 'stats', got '%.100s'\n",
                     line);
        else if (i < 0 || i >= n || ioctl(tun[i], TUNSETCARRIER, &on) < 0)
            snprintf(out, sizeof out, "error: '%.100s': no such host or no carrier control\n",
                     line);
        else
            down[i] = !on;
        reply(out);
        have -= (size_t)(nl + 1 - line);
        memmove(line, nl + 1, have);
    }
    if (have == sizeof line - 1)
        have = 0; /* a line too long for any command: forget it */
    return 1;
}

int main(int argc, char **argv) {
    long queue_kib = 16384;
    int opt, priority = 0;
    while ((opt = getopt(argc, argv, "p:s:q:")) != -1) {
        if (opt == 'p')
            priority = atoi(optarg);
        else if (opt == 's')
            spin_max_ns = (uint64_t)atol(optarg) * 1000;
        else if (opt == 'q')
            queue_kib = atol(optarg);
        else
            goto usage;
    }
    n = argc - optind - 1;
    if (n < 1 || n > MAX_HOSTS || queue_kib * 1024 < (long)REC_MAX * 2)
        goto usage;
    delay_ns = (uint64_t)atol(argv[optind]) * 1000;
    cap = (size_t)queue_kib * 1024;
    if (!(ring = malloc(cap)))
        die("latency_router: the packet ring");
    wrap_at = cap;

    prctl(PR_SET_PDEATHSIG, SIGTERM);
    prctl(PR_SET_TIMERSLACK, 1UL);
    struct sched_param sp = {.sched_priority = priority};
    if (priority > 0 && sched_setscheduler(0, SCHED_FIFO, &sp) < 0)
        perror("latency_router: SCHED_FIFO (going on without it)");
    sigset_t blocked, unblocked; /* SIGTERM and SIGINT come only while ppoll() waits */
    sigemptyset(&blocked);
    sigaddset(&blocked, SIGTERM);
    sigaddset(&blocked, SIGINT);
    sigprocmask(SIG_BLOCK, &blocked, &unblocked);
    struct sigaction sa = {.sa_handler = on_signal};
    sigaction(SIGTERM, &sa, NULL);
    sigaction(SIGINT, &sa, NULL);
    if (getppid() == 1)
        return 0; /* the parent is gone already */

    struct pollfd pfd[MAX_HOSTS + 1];
    for (int i = 0; i < n; i++) {
        char *arg = argv[optind + 1 + i], *eq = strchr(arg, '=');
        struct ifreq ifr = {.ifr_flags = IFF_TUN | IFF_NO_PI};
        if (!eq || eq - arg >= IFNAMSIZ || inet_pton(AF_INET, eq + 1, &addr[i]) != 1)
            goto usage;
        memcpy(ifr.ifr_name, arg, (size_t)(eq - arg));
        if ((tun[i] = open("/dev/net/tun", O_RDWR | O_NONBLOCK | O_CLOEXEC)) < 0)
            die("latency_router: /dev/net/tun");
        if (ioctl(tun[i], TUNSETIFF, &ifr) < 0)
            die("latency_router: TUNSETIFF");
        pfd[i] = (struct pollfd){.fd = tun[i], .events = POLLIN};
    }
    pfd[n] = (struct pollfd){.fd = 0, .events = POLLIN};
    fcntl(0, F_SETFL, fcntl(0, F_GETFL) | O_NONBLOCK);
    reply("ready\n");

    while (!stop) {
        flush();
        struct timespec ts, *timeout = NULL;
        uint64_t now = now_ns(), wake = now;
        if (queued) {
            uint64_t due = ((struct rec *)(ring + head))->due;
            wake = due > now + early_ns ? due - early_ns : now; /* now: poll, do not sleep */
            ts = (struct timespec){.tv_sec = (time_t)((wake - now) / 1000000000u),
                                   .tv_nsec = (long)((wake - now) % 1000000000u)};
            timeout = &ts;
        }
        int ready = ppoll(pfd, (nfds_t)n + 1, timeout, &unblocked);
        if (ready == 0 && wake > now) { /* slept the whole timeout: learn how late that wakes */
            uint64_t late = now_ns() - wake;
            early_ns = early_ns - early_ns / 8 + (late < spin_max_ns ? late : spin_max_ns) / 8;
        }
        if (ready <= 0)
            continue;
        if (pfd[n].revents && !control())
            break;
        for (int i = 0; i < n; i++)
            if (pfd[i].revents & POLLIN)
                for (int k = 0; k < BATCH && receive(&pfd[i], i); k++)
                    flush();
    }
    char out[1024];
    stats(out, sizeof out);
    fprintf(stderr, "latency_router: %s", out);
    return 0;
usage:
    fprintf(stderr, "usage: latency_router [-p PRIORITY] [-s SPIN_US] [-q QUEUE_KIB >= %zu] "
            "DELAY_US NAME=ADDR... (1 to %d devices, NAME at most %d characters)\n",
            2 * REC_MAX / 1024 + 1, MAX_HOSTS, IFNAMSIZ - 1);
    return 2;
}
