// Round-trip floors of two processes on other kernel paths than a socket:
// a futex over one shared page, and a pair of pipes. Each mode forks a
// server that answers every request; the parent times N round trips of
// 40 bytes (as latbench's is_offloaded exchange) and prints p50 and p90 in
// ns. Pin it with taskset to compare with cmd/latbench's C echo:
//
//	cc -O2 -o /tmp/floors hack/floors.c
//	taskset -c 0 /tmp/floors futex 200000
//	taskset -c 0 /tmp/floors pipe 200000
//
// The pipe modes differ in how a side waits for its packet: pipe, in a
// blocking read; ppoll, as a kvpool lane waits (pkg/wire/lane.go), in
// ppoll on the non-blocking pipe and a socket, without a timeout, then a
// read; ppoll-timer, the same with a timeout of 10 ms, which a wake-up
// before it cancels (what a timer costs a wait).
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/futex.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

struct page {
	_Atomic int req, rep;
	char buf[40];
};

static long futex(_Atomic int *addr, int op, int val) {
	return syscall(SYS_futex, addr, op, val, NULL, NULL, 0);
}

static long long now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
	long long x = *(const long long *)a, y = *(const long long *)b;
	return (x > y) - (x < y);
}

static void futexServe(struct page *p) {
	int seen = 0;
	for (;;) {
		int v;
		while ((v = atomic_load(&p->req)) == seen)
			futex(&p->req, FUTEX_WAIT, seen);
		seen = v;
		if (v < 0)
			_exit(0);
		atomic_store(&p->rep, v);
		futex(&p->rep, FUTEX_WAKE, 1);
	}
}

static void futexCall(struct page *p, int i) {
	atomic_store(&p->req, i);
	futex(&p->req, FUTEX_WAKE, 1);
	int v;
	while ((v = atomic_load(&p->rep)) != i)
		futex(&p->rep, FUTEX_WAIT, v);
}

// waitMode is how a pipe's reader waits: 0 a blocking read, 1 ppoll, 2
// ppoll with a timeout; sock is the socket ppoll watches beside the pipe
// (for its end alone, as a lane does).
static int waitMode, sock;

static ssize_t readPipe(int fd, char *b, size_t n) {
	for (;;) {
		if (waitMode) {
			struct pollfd p[2] = {{fd, POLLIN, 0}, {sock, 0, 0}};
			struct timespec ts = {0, 10000000};
			ppoll(p, 2, waitMode == 2 ? &ts : NULL, NULL);
		}
		ssize_t r = read(fd, b, n);
		if (r >= 0 || errno != EAGAIN)
			return r;
	}
}

static void pipeServe(int in, int out) {
	char b[40];
	while (readPipe(in, b, sizeof b) == sizeof b)
		if (write(out, b, sizeof b) != sizeof b)
			break;
	_exit(0);
}

int main(int argc, char **argv) {
	const char *modes[] = {"pipe", "ppoll", "ppoll-timer"};
	int usePipe = 0;
	for (int i = 0; argc == 3 && i < 3; i++)
		if (!strcmp(argv[1], modes[i]))
			usePipe = 1, waitMode = i;
	if (argc != 3 || (!usePipe && strcmp(argv[1], "futex"))) {
		fprintf(stderr, "usage: floors futex|pipe|ppoll|ppoll-timer N\n");
		return 2;
	}
	int n = atoi(argv[2]);
	if (n < 1) {
		fprintf(stderr, "floors: N must be a positive count, got %s\n", argv[2]);
		return 2;
	}
	struct page *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	int toServer[2], toClient[2], pair[2];
	int fl = waitMode ? O_NONBLOCK : 0;
	if (p == MAP_FAILED || pipe2(toServer, fl) || pipe2(toClient, fl) || socketpair(AF_UNIX, SOCK_SEQPACKET, 0, pair)) {
		perror("setup");
		return 1;
	}
	sock = pair[0];
	pid_t pid = fork();
	if (pid == 0) {
		close(toServer[1]);
		close(toClient[0]);
		if (usePipe)
			pipeServe(toServer[0], toClient[1]);
		futexServe(p);
	}
	close(toServer[0]);
	close(toClient[1]);
	long long *lat = malloc(sizeof *lat * (size_t)n);
	if (!lat) {
		perror("malloc");
		return 1;
	}
	char b[40] = {0};
	for (int i = 1; i <= n; i++) {
		long long t = now();
		if (usePipe) {
			if (write(toServer[1], b, sizeof b) != sizeof b || readPipe(toClient[0], b, sizeof b) != sizeof b) {
				perror("pipe");
				return 1;
			}
		} else {
			futexCall(p, i);
		}
		lat[i - 1] = now() - t;
	}
	atomic_store(&p->req, -1);
	futex(&p->req, FUTEX_WAKE, 1);
	close(toServer[1]);
	waitpid(pid, NULL, 0);
	qsort(lat, n, sizeof *lat, cmp);
	printf("%s p50 %lld p90 %lld n %d\n", argv[1], lat[n / 2], lat[n * 9 / 10], n);
	return 0;
}
