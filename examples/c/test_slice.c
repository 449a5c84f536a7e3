/*
 * test_slice.c - a C server moves one live TCP session through pliant's Slice calls and goes
 * on serving it: the client sees every byte once, in order, and no reset. Run in a network
 * namespace of its own (the Makefile uses `unshare --net`): its packet hold adds a veth pair
 * and a filter on loopback there (or an nftables table, the fallback).
 *
 * The session: the client sends bytes the server has not read yet (they travel in the
 * capsule's receive queue), the server has written bytes the client has not read yet (the
 * send queue), and the client keeps sending while the connection is held; then the restored
 * socket serves on. Bad input: a damaged capsule, one of another format version, and a
 * restore onto a 4-tuple still in use are refused with their codes, the session untouched.
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "pliant.h"

static int failures;

#define CHECK(cond, ...)                                                                       \
    do {                                                                                       \
        if (!(cond)) {                                                                         \
            fprintf(stderr, "FAIL %s:%d: ", __FILE__, __LINE__);                               \
            fprintf(stderr, __VA_ARGS__);                                                      \
            fprintf(stderr, " (last error: %s)\n", pliant_slice_last_error());                 \
            failures++;                                                                        \
        }                                                                                      \
    } while (0)

static void die(const char *what) {
    perror(what);
    exit(2);
}

/* Reads exactly n bytes within 5 s; returns what it read (less on EOF, error or timeout). */
static size_t read_n(int fd, char *buf, size_t n) {
    size_t got = 0;
    while (got < n) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        if (poll(&p, 1, 5000) <= 0)
            break;
        ssize_t k = recv(fd, buf + got, n - got, 0);
        if (k <= 0)
            break;
        got += (size_t)k;
    }
    return got;
}

static void send_all(int fd, const char *s, size_t n) {
    if (send(fd, s, n, MSG_NOSIGNAL) != (ssize_t)n)
        die("send");
}

int main(void) {
    if (system("ip link set lo up") != 0) {
        fprintf(stderr, "cannot bring lo up (run in a namespace of its own, as root)\n");
        return 2;
    }
    int l = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t alen = sizeof a;
    int one = 1;
    setsockopt(l, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (bind(l, (struct sockaddr *)&a, sizeof a) || listen(l, 4) ||
        getsockname(l, (struct sockaddr *)&a, &alen))
        die("listen");
    int c = socket(AF_INET, SOCK_STREAM, 0);
    if (connect(c, (struct sockaddr *)&a, sizeof a))
        die("connect");
    int s = accept(l, NULL, NULL);
    if (s < 0)
        die("accept");

    /* A live exchange first, then bytes each side has not read yet. */
    char buf[256];
    send_all(c, "hello\n", 6);
    CHECK(read_n(s, buf, 6) == 6 && memcmp(buf, "hello\n", 6) == 0, "first request");
    send_all(s, "welcome\n", 8);
    send_all(c, "unread-by-server\n", 17);
    send_all(s, "unread-by-client\n", 17);
    usleep(50 * 1000); /* both delivered and acknowledged by the kernels */

    PliantSliceHold *h = pliant_slice_hold_open("ctest");
    CHECK(h != NULL, "hold_open");
    if (!h)
        return 1;
    CHECK(pliant_slice_hold(h, s) == PLIANT_OK, "hold");
    uint8_t *cap = NULL;
    size_t cap_len = 0;
    const char *app = "session-state: 42 lines";
    CHECK(pliant_slice_capture(s, 7, (const uint8_t *)"pending-out\n", 12, (const uint8_t *)app,
                               strlen(app), &cap, &cap_len) == PLIANT_OK,
          "capture");

    /* Bad input, with the original socket still holding the 4-tuple. */
    int fd2 = -1;
    uint64_t id = 0;
    uint8_t *pend = NULL, *appb = NULL;
    size_t pend_len = 0, app_len = 0;
    int rc = pliant_slice_restore(cap, cap_len, &fd2, &id, &pend, &pend_len, &appb, &app_len);
    CHECK(rc == PLIANT_EEXIST, "restore onto a 4-tuple in use: %d", rc);
    CHECK(strstr(pliant_slice_last_error(), "in use") != NULL, "error names the 4-tuple in use");
    uint8_t *bad = malloc(cap_len);
    memcpy(bad, cap, cap_len);
    bad[cap_len - 1] ^= 0x40;
    rc = pliant_slice_restore(bad, cap_len, &fd2, &id, &pend, &pend_len, &appb, &app_len);
    CHECK(rc == PLIANT_EDECODE, "damaged capsule: %d", rc);
    memcpy(bad, cap, cap_len);
    bad[4] = 0x7f; /* the format version after the magic */
    rc = pliant_slice_restore(bad, cap_len, &fd2, &id, &pend, &pend_len, &appb, &app_len);
    CHECK(rc == PLIANT_EDECODE && strstr(pliant_slice_last_error(), "version") != NULL,
          "another format version: %d", rc);
    free(bad);
    CHECK(fd2 == -1 && pend == NULL && appb == NULL, "nothing returned on failure");

    /* The move: the old socket goes silently, the client keeps sending meanwhile. */
    CHECK(pliant_slice_close_silent(s) == PLIANT_OK, "close_silent");
    send_all(c, "sent-while-held\n", 16);
    rc = pliant_slice_restore(cap, cap_len, &fd2, &id, &pend, &pend_len, &appb, &app_len);
    CHECK(rc == PLIANT_OK, "restore: %d", rc);
    pliant_slice_free(cap, cap_len);
    if (rc != PLIANT_OK)
        return 1;
    CHECK(id == 7, "session id %llu", (unsigned long long)id);
    CHECK(app_len == strlen(app) && memcmp(appb, app, app_len) == 0, "application bytes");
    CHECK(pend_len == 12 && memcmp(pend, "pending-out\n", 12) == 0, "pending output");
    CHECK(pliant_slice_release(h, fd2) == PLIANT_OK, "release");
    CHECK(pliant_slice_resume(fd2) == PLIANT_OK, "resume");
    send_all(fd2, (const char *)pend, pend_len);
    pliant_slice_free(pend, pend_len);
    pliant_slice_free(appb, app_len);

    /* Everything arrives once and in order, both ways. */
    const char *to_server = "unread-by-server\nsent-while-held\n";
    size_t n = read_n(fd2, buf, strlen(to_server));
    CHECK(n == strlen(to_server) && memcmp(buf, to_server, n) == 0, "server reads %zu: %.*s", n,
          (int)n, buf);
    const char *to_client = "welcome\nunread-by-client\npending-out\n";
    n = read_n(c, buf, strlen(to_client));
    CHECK(n == strlen(to_client) && memcmp(buf, to_client, n) == 0, "client reads %zu: %.*s", n,
          (int)n, buf);
    send_all(c, "after\n", 6);
    CHECK(read_n(fd2, buf, 6) == 6 && memcmp(buf, "after\n", 6) == 0, "served after the move");
    send_all(fd2, "bye\n", 4);
    CHECK(read_n(c, buf, 4) == 4 && memcmp(buf, "bye\n", 4) == 0, "client after the move");
    int err = 0;
    socklen_t el = sizeof err;
    getsockopt(c, SOL_SOCKET, SO_ERROR, &err, &el);
    CHECK(err == 0, "client socket error %d (%s)", err, strerror(err));

    /* A capture of something that is not a connection leaves it alone. */
    rc = pliant_slice_capture(l, 1, NULL, 0, NULL, 0, &cap, &cap_len);
    CHECK(rc != PLIANT_OK, "capture of a listener refused");

    pliant_slice_hold_close(h);
    close(fd2);
    close(c);
    close(l);
    if (failures) {
        fprintf(stderr, "test_slice: %d failure(s)\n", failures);
        return 1;
    }
    printf("test_slice: a session moved through the C ABI, every byte once, no reset\n");
    return 0;
}
