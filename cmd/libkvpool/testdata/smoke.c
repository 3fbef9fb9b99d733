/* A C program against kvpool.h and libkvpool.so: what a C or C++ engine
 * does. Run by abi_test.go with KVPOOL_SOCKET and KVPOOL_TOKEN set; the
 * "device" KV cache is malloc'd memory on the simulator. Exits 0 when every
 * check held; prints the first failure otherwise. */
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kvpool.h"

#define PAGES 32
#define PAGE 512

static int failures;
#define CHECK(cond, ...)                                                  \
	do {                                                                  \
		if (!(cond)) {                                                    \
			char msg[512];                                                \
			kvpool_last_error(msg, sizeof msg);                           \
			fprintf(stderr, "FAIL line %d: ", __LINE__);                  \
			fprintf(stderr, __VA_ARGS__);                                 \
			fprintf(stderr, " (last error: %s)\n", msg);                  \
			failures++;                                                   \
		}                                                                 \
	} while (0)

/* Two threads failing at once, each its own way: kvpool_last_error is per
 * thread, so each reads its own message after every failure. */
struct racer {
	kvpool_handle h;
	int which, bad;
};

static void *race(void *arg) {
	struct racer *r = arg;
	char msg[256];
	int32_t page = 1, host[1];
	kvpool_stream_meta meta;
	for (int i = 0; i < 300; i++) {
		const char *want;
		if (r->which == 0) {
			if (kvpool_reload(r->h, "ghost", 5, "x", 1, &page, 1, host, 1, &meta) != KVPOOL_ERR_UNKNOWN_STREAM) {
				r->bad++;
				continue;
			}
			want = "unknown stream";
		} else {
			if (kvpool_num_free_pages(r->h + 1000, NULL) != KVPOOL_ERR_BAD_HANDLE) {
				r->bad++;
				continue;
			}
			want = "not an open handle";
		}
		kvpool_last_error(msg, sizeof msg);
		if (strstr(msg, want) == NULL) {
			fprintf(stderr, "thread %d read another thread's message: %s\n", r->which, msg);
			r->bad++;
		}
	}
	return NULL;
}

int main(void) {
	CHECK(kvpool_abi_version() == KVPOOL_ABI_VERSION, "abi version %d", kvpool_abi_version());
	unsigned char *k = malloc(PAGES * PAGE), *v = malloc(PAGES * PAGE);
	for (int i = 0; i < PAGES * PAGE; i++) {
		k[i] = (unsigned char)(i * 7 + 1);
		v[i] = (unsigned char)(i * 13 + 5);
	}
	kvpool_region regions[2] = {
	    {(uint64_t)(uintptr_t)k, PAGE, PAGE, PAGES},
	    {(uint64_t)(uintptr_t)v, PAGE, PAGE, PAGES},
	};
	kvpool_options o;
	memset(&o, 0, sizeof o);
	o.struct_size = sizeof o;
	o.backend = "sim";
	o.regions = regions;
	o.n_regions = 2;
	o.max_pages = 8;
	o.sim_copy_delay_us = 1000;
	kvpool_handle h = 0;

	/* Misuse before any request: a clear status and message, no handle. */
	kvpool_options bad = o;
	bad.struct_size = 8;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_INVALID && h == 0, "open with a wrong struct_size");
	char msg[256];
	size_t n = kvpool_last_error(msg, sizeof msg);
	CHECK(n > 0 && strstr(msg, "struct_size") != NULL, "message for struct_size: %s", msg);
	CHECK(kvpool_last_error(msg, 4) == n && strlen(msg) == 3, "truncated message");
	bad = o;
	bad.n_regions = 0;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_INVALID, "open with no regions");
	bad = o;
	bad.backend = "tpu";
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_OTHER, "open with an unknown backend");
	bad = o;
	bad.token = "not-a-token";
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_UNAUTHORIZED, "open with a bad token");
	bad = o;
	bad.spin_wait_us = 1001;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_INVALID && h == 0, "open with spin_wait_us over the limit");
	kvpool_last_error(msg, sizeof msg);
	CHECK(strstr(msg, "spin_wait_us") != NULL, "message for spin_wait_us: %s", msg);
	/* A caller built before spin_wait_us existed passes the shorter struct;
	 * what lies beyond it is not read. */
	bad = o;
	bad.struct_size = offsetof(kvpool_options, spin_wait_us);
	bad.spin_wait_us = 1001;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_OK && h != 0, "open with the first release's struct_size");
	CHECK(kvpool_close(h) == KVPOOL_OK, "close");
	h = 0;
	bad = o;
	bad.ranks = -1;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_INVALID && h == 0, "open with negative ranks");
	kvpool_last_error(msg, sizeof msg);
	CHECK(strstr(msg, "ranks") != NULL, "message for ranks: %s", msg);
	bad = o;
	bad.reserved = 1;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_ERR_INVALID && h == 0, "open with reserved set");
	/* The second release's struct ends before ranks: not read. */
	bad = o;
	bad.struct_size = offsetof(kvpool_options, ranks);
	bad.ranks = -5;
	CHECK(kvpool_open(&bad, &h) == KVPOOL_OK && h != 0, "open with the second release's struct_size");
	CHECK(kvpool_close(h) == KVPOOL_OK, "close");
	h = 0;
	CHECK(kvpool_open(NULL, &h) == KVPOOL_ERR_INVALID, "open with NULL options");
	CHECK(kvpool_offload(12345, "r", 1, "l", 1, NULL, 0, 0, 0, 0) == KVPOOL_ERR_BAD_HANDLE, "bad handle");

	o.ranks = 1;
	CHECK(kvpool_open(&o, &h) == KVPOOL_OK && h != 0, "open");
	/* Where the session's one chunk lies: on the GPU's node, or unknown. */
	kvpool_locality loc;
	memset(&loc, 0, sizeof loc);
	CHECK(kvpool_locality_get(h, &loc) == KVPOOL_ERR_INVALID, "locality without struct_size");
	loc.struct_size = sizeof loc;
	CHECK(kvpool_locality_get(h, &loc) == KVPOOL_OK && loc.chunks == 1 && loc.ranks == 1 && loc.remote == 0 &&
	          loc.local + loc.unknown == 1,
	      "locality: gpu_numa %d, ranks %d, chunks %d, local %d, remote %d, unknown %d", loc.gpu_numa, loc.ranks,
	      loc.chunks, loc.local, loc.remote, loc.unknown);
	int32_t numa[4] = {-9, -9, -9, -9};
	int64_t nchunks = 0;
	CHECK(kvpool_chunk_numa(h, numa, 0, &nchunks) == KVPOOL_ERR_BUFFER_TOO_SMALL && nchunks == 1 && numa[0] == -9,
	      "chunk_numa into no room");
	CHECK(kvpool_chunk_numa(h, numa, 4, &nchunks) == KVPOOL_OK && nchunks == 1 && numa[1] == -9 &&
	          (loc.local == 1 ? numa[0] == loc.gpu_numa : numa[0] == -1 || loc.gpu_numa == -1),
	      "chunk_numa: %d of %lld", numa[0], (long long)nchunks);
	CHECK(kvpool_chunk_numa(h, NULL, 4, &nchunks) == KVPOOL_ERR_INVALID, "chunk_numa NULL buffer");
	kvpool_info info;
	CHECK(kvpool_info_get(h, &info) == KVPOOL_OK && info.capacity == 8 && info.host_page_bytes == 2 * PAGE &&
	          info.simulated == 1,
	      "info: capacity %lld, page %llu", (long long)info.capacity, (unsigned long long)info.host_page_bytes);

	int32_t out[3] = {4, 9, 30}, back[3] = {1, 2, 3};
	unsigned char want_k[3][PAGE], want_v[3][PAGE];
	for (int i = 0; i < 3; i++) {
		memcpy(want_k[i], k + out[i] * PAGE, PAGE);
		memcpy(want_v[i], v + out[i] * PAGE, PAGE);
	}
	CHECK(kvpool_offload(h, "req", 3, "main", 4, out, 3, 100, 101, 2) == 1, "offload");
	CHECK(kvpool_offload(h, "req", 3, "big", 3, back, 3, 0, 0, 0) == 1, "offload 2");
	int32_t many[4] = {10, 11, 12, 13};
	CHECK(kvpool_offload(h, "req2", 4, "x", 1, many, 4, 0, 0, 0) == 0, "offload into a full pool is 0");
	int64_t free_pages = -1;
	CHECK(kvpool_num_free_pages(h, &free_pages) == KVPOOL_OK && free_pages == 2, "free %lld", (long long)free_pages);
	CHECK(kvpool_offload(h, "req", 3, "main", 4, many, 1, 0, 0, 0) == KVPOOL_ERR_DUPLICATE_STREAM, "duplicate");
	int32_t oob[1] = {PAGES};
	CHECK(kvpool_offload(h, "r9", 2, "a", 1, oob, 1, 0, 0, 0) == KVPOOL_ERR_OUT_OF_RANGE, "out of range");
	CHECK(kvpool_offload(h, "r9", 2, "a", 1, NULL, 1, 0, 0, 0) == KVPOOL_ERR_INVALID, "NULL pages");
	CHECK(kvpool_num_free_pages(h, &free_pages) == KVPOOL_OK && free_pages == 2, "misuse changed the free pages");

	/* Labels: too small, then right. */
	char buf[64];
	size_t ends[4], nl = 0, nb = 0;
	CHECK(kvpool_labels(h, "req", 3, buf, 2, ends, 4, &nl, &nb) == KVPOOL_ERR_BUFFER_TOO_SMALL && nl == 2 && nb == 7,
	      "labels too small: %zu %zu", nl, nb);
	CHECK(kvpool_labels(h, "req", 3, buf, sizeof buf, ends, 4, &nl, &nb) == KVPOOL_OK && nl == 2 && ends[0] == 4 &&
	          ends[1] == 7 && memcmp(buf, "mainbig", 7) == 0,
	      "labels");
	CHECK(kvpool_is_offloaded(h, "req", 3) == 1 && kvpool_is_offloaded(h, "nope", 4) == 0, "is_offloaded");
	int64_t np = -1;
	CHECK(kvpool_num_pages(h, "req", 3, "main", 4, &np) == KVPOOL_OK && np == 3, "num_pages");
	CHECK(kvpool_num_pages(h, "req", 3, "zzz", 3, &np) == KVPOOL_OK && np == 0, "num_pages unknown is 0");
	CHECK(kvpool_discard(h, "req", 3, "big", 3) == KVPOOL_OK, "discard");

	/* Round trip onto poisoned pages, ordered by sync on the default stream. */
	CHECK(kvpool_sync(h, 0) == KVPOOL_OK && kvpool_stream_synchronize(h, 0) == KVPOOL_OK, "sync");
	for (int i = 0; i < 3; i++) {
		memset(k + back[i] * PAGE, 0xEE, PAGE);
		memset(v + back[i] * PAGE, 0xEE, PAGE);
	}
	int32_t host[2];
	kvpool_stream_meta meta;
	CHECK(kvpool_reload(h, "req", 3, "main", 4, back, 3, host, 2, &meta) == KVPOOL_ERR_BUFFER_TOO_SMALL,
	      "reload into a small buffer");
	int32_t host3[3];
	CHECK(kvpool_reload(h, "req", 3, "main", 4, back, 2, host3, 3, &meta) == KVPOOL_ERR_PAGE_COUNT, "page count");
	CHECK(kvpool_reload(h, "req", 3, "main", 4, back, 3, host3, 3, &meta) == KVPOOL_OK && meta.stored_len == 100 &&
	          meta.position == 101 && meta.released == 2 && meta.num_pages == 3,
	      "reload");
	CHECK(kvpool_sync(h, 0) == KVPOOL_OK && kvpool_stream_synchronize(h, 0) == KVPOOL_OK, "sync after reload");
	for (int i = 0; i < 3; i++) {
		CHECK(memcmp(k + back[i] * PAGE, want_k[i], PAGE) == 0, "K page %d", back[i]);
		CHECK(memcmp(v + back[i] * PAGE, want_v[i], PAGE) == 0, "V page %d", back[i]);
	}
	CHECK(kvpool_reload(h, "req", 3, "main", 4, back, 3, host3, 3, &meta) == KVPOOL_ERR_UNKNOWN_STREAM,
	      "reload twice");
	n = kvpool_last_error(msg, sizeof msg);
	CHECK(strstr(msg, "unknown stream") != NULL, "unknown stream message: %s", msg);
	struct racer racers[2] = {{h, 0, 0}, {h, 1, 0}};
	pthread_t threads[2];
	for (int i = 0; i < 2; i++) {
		CHECK(pthread_create(&threads[i], NULL, race, &racers[i]) == 0, "pthread_create");
	}
	for (int i = 0; i < 2; i++) {
		pthread_join(threads[i], NULL);
		CHECK(racers[i].bad == 0, "thread %d: %d wrong statuses or messages", i, racers[i].bad);
	}
	CHECK(kvpool_remove_request(h, "req", 3) == KVPOOL_OK && kvpool_is_offloaded(h, "req", 3) == 0, "remove");
	CHECK(kvpool_synchronize(h) == KVPOOL_OK, "synchronize");
	CHECK(kvpool_close(h) == KVPOOL_OK, "close");
	CHECK(kvpool_close(h) == KVPOOL_ERR_BAD_HANDLE, "close twice");
	free(k);
	free(v);
	if (failures) {
		fprintf(stderr, "%d checks failed\n", failures);
		return 1;
	}
	printf("C ABI: OK\n");
	return 0;
}
