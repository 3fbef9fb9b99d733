// A blocking request/reply echo over a SOCK_SEQPACKET Unix socket: the floor
// that cmd/latbench measures kvpool's round trips against. Plain blocking
// send and recv, one thread, no poller.
//
//	echo serve PATH                     serve one connection at a time
//	echo call PATH N REQ REP [REQ REP]  N calls of exchanges; prints ns per call
//
// A request's first 4 bytes (little endian) give the size of its reply.
#define _GNU_SOURCE
#include <errno.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

enum { MAXPKT = 1 << 17 };
static unsigned char buf[MAXPKT + 1];

static int sock(const char *path, struct sockaddr_un *a) {
	int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
	if (fd < 0) { perror("socket"); exit(1); }
	memset(a, 0, sizeof *a);
	a->sun_family = AF_UNIX;
	if (strlen(path) >= sizeof a->sun_path) { fprintf(stderr, "path too long\n"); exit(1); }
	strcpy(a->sun_path, path);
	return fd;
}

static int serve(const char *path) {
	struct sockaddr_un a;
	int l = sock(path, &a);
	if (bind(l, (struct sockaddr *)&a, sizeof a) < 0 || listen(l, 8) < 0) { perror("bind/listen"); return 1; }
	printf("ready\n");
	fflush(stdout);
	for (;;) {
		int c = accept4(l, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) { if (errno == EINTR) continue; perror("accept"); return 1; }
		for (;;) {
			ssize_t n = recv(c, buf, sizeof buf, 0);
			if (n <= 0) break;
			uint32_t r = 0;
			if (n >= 4) memcpy(&r, buf, 4);
			if (r == 0 || r > MAXPKT) r = (uint32_t)n;
			if (send(c, buf, r, 0) != (ssize_t)r) break;
		}
		close(c);
	}
}

static int64_t now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int call(const char *path, long n, int npairs, char **pairs) {
	struct sockaddr_un a;
	int fd = sock(path, &a);
	if (connect(fd, (struct sockaddr *)&a, sizeof a) < 0) { perror("connect"); return 1; }
	uint32_t q[16], r[16];
	for (int i = 0; i < npairs; i++) {
		q[i] = (uint32_t)atoi(pairs[2 * i]);
		r[i] = (uint32_t)atoi(pairs[2 * i + 1]);
		if (q[i] < 4 || q[i] > MAXPKT || r[i] < 1 || r[i] > MAXPKT) { fprintf(stderr, "bad sizes\n"); return 1; }
	}
	int64_t *lat = malloc(sizeof *lat * n);
	for (long k = 0; k < n; k++) {
		int64_t t0 = now();
		for (int i = 0; i < npairs; i++) {
			memcpy(buf, &r[i], 4);
			if (send(fd, buf, q[i], 0) != (ssize_t)q[i]) { perror("send"); return 1; }
			if (recv(fd, buf, sizeof buf, 0) != (ssize_t)r[i]) { perror("recv"); return 1; }
		}
		lat[k] = now() - t0;
	}
	for (long k = 0; k < n; k++) printf("%lld\n", (long long)lat[k]);
	return 0;
}

int main(int argc, char **argv) {
	if (argc == 3 && !strcmp(argv[1], "serve")) return serve(argv[2]);
	if (argc >= 6 && argc % 2 == 0 && argc <= 4 + 32 && !strcmp(argv[1], "call"))
		return call(argv[2], atol(argv[3]), (argc - 4) / 2, argv + 4);
	fprintf(stderr, "usage: echo serve PATH | echo call PATH N REQ REP [REQ REP...]\n");
	return 2;
}
