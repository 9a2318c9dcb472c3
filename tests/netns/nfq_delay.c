/* Adds a fixed delay to every packet an iptables NFQUEUE rule hands to it.
 *
 *     nfq_delay QUEUE DELAY_MS
 *
 * This kernel has no sch_netem, so latency is emulated in user space: each queued packet is held for DELAY_MS and
 * then accepted. The delay is constant, so the packets leave in the order they came (a FIFO ring suffices). Only
 * the metadata is copied from the kernel, never the payload. Prints "ready" once bound; on SIGTERM/SIGINT or when
 * stdin closes it accepts whatever it still holds and exits, so stopping it never drops traffic. Packets beyond the
 * ring's capacity pass at once rather than being dropped (the rule should also use --queue-bypass, so traffic flows
 * when this program is not running).
 *
 * Build: cc -O2 -o nfq_delay nfq_delay.c -lnetfilter_queue
 */
#include <errno.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <arpa/inet.h>
#include <linux/netfilter.h>
#include <linux/netlink.h>
#include <libnetfilter_queue/libnetfilter_queue.h>

#define RING 65536u

static uint32_t held_id[RING];
static int64_t held_due[RING];
static uint32_t head, tail;
static int64_t delay_ns;
static uint64_t passed, overflowed;
static volatile sig_atomic_t stopping;

static int64_t now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static int on_packet(struct nfq_q_handle *qh, struct nfgenmsg *msg, struct nfq_data *nfa, void *data) {
    (void)msg;
    (void)data;
    struct nfqnl_msg_packet_hdr *ph = nfq_get_msg_packet_hdr(nfa);
    if (ph == NULL) return 0;
    uint32_t id = ntohl(ph->packet_id);
    if (tail - head >= RING) { /* full: better late ordering than a drop */
        overflowed++;
        return nfq_set_verdict(qh, id, NF_ACCEPT, 0, NULL);
    }
    held_id[tail % RING] = id;
    held_due[tail % RING] = now_ns() + delay_ns;
    tail++;
    return 0;
}

static void release(struct nfq_q_handle *qh, int64_t upto) {
    while (head != tail && held_due[head % RING] <= upto) {
        nfq_set_verdict(qh, held_id[head % RING], NF_ACCEPT, 0, NULL);
        head++;
        passed++;
    }
}

static void on_signal(int sig) {
    (void)sig;
    stopping = 1;
}

static int wait_ms(void) {
    if (head == tail) return 200;
    int64_t left = held_due[head % RING] - now_ns();
    if (left <= 0) return 0;
    return (int)((left + 999999) / 1000000); /* round up: never release early */
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s QUEUE DELAY_MS\n", argv[0]);
        return 2;
    }
    int queue = atoi(argv[1]);
    delay_ns = (int64_t)(atof(argv[2]) * 1e6);
    struct nfq_handle *h = nfq_open();
    if (h == NULL) { perror("nfq_open"); return 1; }
    if (nfq_bind_pf(h, AF_INET) < 0) { perror("nfq_bind_pf"); return 1; }
    struct nfq_q_handle *qh = nfq_create_queue(h, (uint16_t)queue, &on_packet, NULL);
    if (qh == NULL) { perror("nfq_create_queue"); return 1; }
    if (nfq_set_mode(qh, NFQNL_COPY_META, 0) < 0) { perror("nfq_set_mode"); return 1; }
    nfq_set_queue_maxlen(qh, RING);
    nfnl_rcvbufsiz(nfq_nfnlh(h), 16 << 20);
    int fd = nfq_fd(h);
    int one = 1;
    setsockopt(fd, SOL_NETLINK, NETLINK_NO_ENOBUFS, &one, sizeof one); /* a burst must not kill the loop */
    signal(SIGTERM, on_signal);
    signal(SIGINT, on_signal);
    printf("ready\n");
    fflush(stdout);

    char buf[65536] __attribute__((aligned));
    struct pollfd fds[2] = {{.fd = fd, .events = POLLIN}, {.fd = STDIN_FILENO, .events = POLLIN}};
    while (!stopping) {
        int n = poll(fds, 2, wait_ms());
        if (n < 0 && errno != EINTR) { perror("poll"); break; }
        if (fds[1].revents & (POLLIN | POLLHUP)) {
            char c;
            if (read(STDIN_FILENO, &c, 1) <= 0) break; /* the test that started us is gone */
        }
        if (fds[0].revents & POLLIN) {
            ssize_t got;
            while ((got = recv(fd, buf, sizeof buf, MSG_DONTWAIT)) > 0) nfq_handle_packet(h, buf, (int)got);
        }
        release(qh, now_ns());
    }
    release(qh, INT64_MAX);
    fprintf(stderr, "nfq_delay: %llu packets delayed, %llu passed undelayed (ring full)\n",
            (unsigned long long)passed, (unsigned long long)overflowed);
    nfq_destroy_queue(qh);
    nfq_close(h);
    return 0;
}
