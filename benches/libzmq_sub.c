/* libzmq's own SUB receiving the benchmark stream: the reference point for
 * benches/zmtp_recv.rs. Built by benches/libzmq_compare.sh (or by the bench itself)
 * against Debian's libzmq3-dev.
 *
 * usage: libzmq_sub ENDPOINT COUNT
 * Receives COUNT multipart messages and prints the nanoseconds between the first
 * message and the last (so connection set-up is not measured). */
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
#include <zmq.h>

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int main(int argc, char **argv) {
    if (argc != 3) {
        fprintf(stderr, "usage: %s ENDPOINT COUNT\n", argv[0]);
        return 2;
    }
    long count = atol(argv[2]);
    void *ctx = zmq_ctx_new();
    void *sock = zmq_socket(ctx, ZMQ_SUB);
    int zero = 0;
    zmq_setsockopt(sock, ZMQ_RCVHWM, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(sock, ZMQ_SUBSCRIBE, "", 0);
    if (zmq_connect(sock, argv[1]) != 0) {
        fprintf(stderr, "connect: %s\n", zmq_strerror(zmq_errno()));
        return 1;
    }
    zmq_msg_t part;
    zmq_msg_init(&part);
    long long start = 0;
    for (long i = 0; i < count; i++) {
        do {
            if (zmq_msg_recv(&part, sock, 0) < 0) {
                fprintf(stderr, "recv: %s\n", zmq_strerror(zmq_errno()));
                return 1;
            }
        } while (zmq_msg_more(&part));
        if (i == 0) {
            start = now_ns();
        }
    }
    printf("%lld\n", now_ns() - start);
    zmq_msg_close(&part);
    zmq_close(sock);
    zmq_ctx_term(ctx);
    return 0;
}
