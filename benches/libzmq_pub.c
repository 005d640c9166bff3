/* libzmq's own PUB sending the fan-out benchmark's stream: the reference point for
 * benches/zmtp_pub.rs. Built by the bench's callers (.ci/run, tools/figures.py)
 * against Debian's libzmq3-dev.
 *
 * usage: libzmq_pub SUBSCRIBERS
 * Binds an XPUB to tcp://127.0.0.1 on a port the OS picks and prints its endpoint,
 * waits for SUBSCRIBERS subscriptions and prints "ready", then for every line "N" on
 * stdin sends N messages [4 B topic, 8 B sequence, 100 B payload] and prints "sent".
 * Lossless: XPUB_NODROP makes a full subscriber pipe refuse the send (EAGAIN) instead
 * of dropping, and the sender waits for room, so every subscriber gets every message.
 * Exits at end of input. */
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

static int send_part(void *sock, const void *data, size_t len, int flags) {
    for (;;) {
        if (zmq_send(sock, data, len, flags | ZMQ_DONTWAIT) >= 0) {
            return 0;
        }
        if (zmq_errno() != EAGAIN) {
            fprintf(stderr, "send: %s\n", zmq_strerror(zmq_errno()));
            return -1;
        }
        zmq_pollitem_t item = {sock, 0, ZMQ_POLLOUT, 0};
        if (zmq_poll(&item, 1, 1000) < 0) {
            fprintf(stderr, "poll: %s\n", zmq_strerror(zmq_errno()));
            return -1;
        }
    }
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: %s SUBSCRIBERS\n", argv[0]);
        return 2;
    }
    long subscribers = atol(argv[1]);
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_XPUB);
    int one = 1, zero = 0;
    zmq_setsockopt(sock, ZMQ_XPUB_NODROP, &one, sizeof one);
    zmq_setsockopt(sock, ZMQ_XPUB_VERBOSE, &one, sizeof one);
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    if (zmq_bind(sock, "tcp://127.0.0.1:*") != 0) {
        fprintf(stderr, "bind: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    char endpoint[256];
    size_t endpoint_len = sizeof endpoint;
    zmq_getsockopt(sock, ZMQ_LAST_ENDPOINT, endpoint, &endpoint_len);
    printf("%s\n", endpoint);
    fflush(stdout);
    /* XPUB_VERBOSE passes every subscription up, one per subscriber. */
    char sub[256];
    for (long seen = 0; seen < subscribers;) {
        int n = zmq_recv(sock, sub, sizeof sub, 0);
        if (n < 0) {
            fprintf(stderr, "recv: %s\n", zmq_strerror(zmq_errno()));
            return 1;
        }
        if (n >= 1 && sub[0] == 1) {
            seen++;
        }
    }
    printf("ready\n");
    fflush(stdout);
    uint8_t payload[100];
    memset(payload, 0xab, sizeof payload);
    uint8_t seq[8] = {0, 0, 0, 0, 0, 0, 0, 7};
    char line[64];
    while (fgets(line, sizeof line, stdin)) {
        long count = atol(line);
        for (long i = 0; i < count; i++) {
            if (send_part(sock, "kvev", 4, ZMQ_SNDMORE) || send_part(sock, seq, 8, ZMQ_SNDMORE) ||
                send_part(sock, payload, sizeof payload, 0)) {
                return 1;
            }
        }
        printf("sent\n");
        fflush(stdout);
    }
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return 0;
}
