// Round-trip floors of two processes on other kernel paths than a socket:
// a futex over one shared page, and a pair of pipes. Each mode forks a
// server that answers every request; the parent times N round trips of
// 40 bytes (as latbench's is_offloaded exchange) and prints p50 and p90 in
// ns. Pin it with taskset to compare with cmd/latbench's C echo:
//
//	cc -O2 -o /tmp/floors hack/floors.c
//	taskset -c 0 /tmp/floors futex 200000
//	taskset -c 0 /tmp/floors pipe 200000
#define _GNU_SOURCE
#include <linux/futex.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
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

static void pipeServe(int in, int out) {
	char b[40];
	while (read(in, b, sizeof b) == sizeof b)
		if (write(out, b, sizeof b) != sizeof b)
			break;
	_exit(0);
}

int main(int argc, char **argv) {
	if (argc != 3 || (strcmp(argv[1], "futex") && strcmp(argv[1], "pipe"))) {
		fprintf(stderr, "usage: floors futex|pipe N\n");
		return 2;
	}
	int n = atoi(argv[2]), usePipe = !strcmp(argv[1], "pipe");
	if (n < 1) {
		fprintf(stderr, "floors: N must be a positive count, got %s\n", argv[2]);
		return 2;
	}
	struct page *p = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	int toServer[2], toClient[2];
	if (p == MAP_FAILED || pipe(toServer) || pipe(toClient)) {
		perror("setup");
		return 1;
	}
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
			if (write(toServer[1], b, sizeof b) != sizeof b || read(toClient[0], b, sizeof b) != sizeof b) {
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
