/*
 * kvpool.h: the C ABI of the kvpool client (libkvpool.so).
 *
 * The library is the Go client (pkg/client over pkg/cudart) built with
 * `go build -buildmode=c-shared`. Everything that crosses this boundary is a
 * C type: opaque 64-bit handles, caller-owned buffers, integer status codes.
 * The library keeps no pointer the caller passed once a call returns, and
 * hands out none that the caller must free.
 *
 * Status: every function returns KVPOOL_OK (0) or a positive answer on
 * success, and a negative KVPOOL_ERR_* on failure; after a failure,
 * kvpool_last_error() on the same thread returns the message. A call that
 * fails with a misuse status (unknown stream, page count, ...) has changed
 * nothing.
 *
 * Strings (rid, label) are passed as pointer and length; they need no NUL
 * terminator and may hold any bytes the agent accepts.
 *
 * Host process rules (docs/c-abi.md): one Go runtime per process, so load
 * one copy of the library; do not fork() after loading it unless the child
 * only exec()s; the Go runtime installs signal handlers with SA_ONSTACK and
 * chains to handlers installed before it; calls are safe from any thread
 * (each handle serializes its own calls).
 */
#ifndef KVPOOL_H
#define KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The ABI version this header describes; kvpool_abi_version() returns the
 * library's. They must be equal. */
#define KVPOOL_ABI_VERSION 1

/* Status codes. */
#define KVPOOL_OK 0
#define KVPOOL_ERR_INVALID -1          /* bad argument, caught before any request */
#define KVPOOL_ERR_BAD_HANDLE -2       /* not an open handle (or already closed) */
#define KVPOOL_ERR_UNKNOWN_STREAM -3   /* no such (rid, label) */
#define KVPOOL_ERR_DUPLICATE_STREAM -4 /* (rid, label) is already offloaded */
#define KVPOOL_ERR_PAGE_COUNT -5       /* wrong number of device pages */
#define KVPOOL_ERR_OUT_OF_RANGE -6     /* a device page index outside the layout */
#define KVPOOL_ERR_DUPLICATE_INDEX -7  /* a device page named twice */
#define KVPOOL_ERR_BAD_NAME -8         /* empty or over-long rid, over-long label */
#define KVPOOL_ERR_BAD_SIZE -9         /* bad layout, negative metadata, ... */
#define KVPOOL_ERR_CLOSED -10          /* the session was ended by the agent */
#define KVPOOL_ERR_DISCONNECTED -11    /* the connection broke; the next call reconnects */
#define KVPOOL_ERR_PROTOCOL -12        /* the agent broke the protocol */
#define KVPOOL_ERR_CUDA -13            /* a CUDA (or simulator) call failed */
#define KVPOOL_ERR_UNAUTHORIZED -14    /* unknown or revoked allocation token */
#define KVPOOL_ERR_BUSY -15            /* another live client holds this GPU's session */
#define KVPOOL_ERR_NO_CAPACITY -16     /* the allocation cannot hold the session */
#define KVPOOL_ERR_BUFFER_TOO_SMALL -17 /* a caller buffer is too small; sizes say how big */
#define KVPOOL_ERR_OTHER -99

typedef uint64_t kvpool_handle;

/* One region of the device KV cache: device page p of the region occupies
 * [base + p*stride, base + p*stride + page_bytes). A host page holds one
 * page of every region, back to back in region order. */
typedef struct kvpool_region {
	uint64_t base;       /* device address (CUdeviceptr) */
	uint64_t stride;     /* bytes between consecutive pages, >= page_bytes */
	uint64_t page_bytes; /* bytes of each page that move */
	int64_t pages;       /* pages in the region */
} kvpool_region;

typedef struct kvpool_options {
	uint32_t struct_size; /* sizeof(kvpool_options): lets the struct grow */
	int32_t device;       /* CUDA device ordinal in this process: the engine's GPU (the agent is told its UUID).
	                       * On the simulator in a container (NVIDIA_VISIBLE_DEVICES set) the simulated devices
	                       * are the visible GPUs, in CUDA_VISIBLE_DEVICES order */
	const char *socket;   /* NULL or "": $KVPOOL_SOCKET, then /var/run/kvpool/kvpool.sock */
	const char *token;    /* NULL or "": $KVPOOL_TOKEN */
	const char *backend;  /* "auto" (NULL, ""), "cuda" or "sim" */
	const char *name;     /* shown in the agent's logs; NULL: "kvpool-c-abi" */
	const kvpool_region *regions;
	int32_t n_regions;
	int32_t sim_devices;       /* simulator only: devices (0: 2) */
	int64_t max_pages;         /* host pages wanted; 0: every free chunk of the allocation */
	uint64_t order_stream;     /* CUstream whose earlier work every copy follows; 0: default stream */
	int64_t timeout_ms;        /* connect and open; 0: 30 s */
	int64_t sim_copy_delay_us; /* simulator only: delay before each batch of copies */
	/* Added after the first release: a caller whose struct_size ends before
	 * a field gets its default. */
	int64_t spin_wait_us; /* poll for a reply this long before the thread sleeps; 0: 50, negative: never */
	/* Added with locality binding: */
	int32_t ranks;    /* sessions (tensor-parallel ranks, one per GPU) sharing the allocation, the engine's
	                   * world size on this node; 0: the agent counts the container's GPUs */
	int32_t reserved; /* must be 0 */
} kvpool_options;

/* Metadata of a stream, as offload_stream recorded it. */
typedef struct kvpool_stream_meta {
	int64_t stored_len;
	int64_t position;
	int64_t released;
	int64_t num_pages; /* host pages the stream held */
} kvpool_stream_meta;

/* Where a session's host memory lies relative to its GPU, as the agent said
 * at open (kvpool_locality_get). An agent too old to say reports every node
 * unknown (-1). */
typedef struct kvpool_locality {
	uint32_t struct_size; /* sizeof(kvpool_locality), set by the caller */
	int32_t gpu_numa;     /* NUMA node of the session's GPU; -1 unknown */
	int32_t ranks;        /* ranks the allocation is shared among; 0 unknown */
	int32_t chunks;       /* chunks the session holds */
	int32_t local;        /* of them on gpu_numa */
	int32_t remote;       /* on another node: copies cross the socket interconnect */
	int32_t unknown;      /* where a node is unknown */
} kvpool_locality;

typedef struct kvpool_info {
	uint64_t session;
	int64_t capacity;         /* host pages of the session */
	uint64_t host_page_bytes; /* bytes of one host page (sum of the regions' page_bytes) */
	int32_t device;
	int32_t simulated; /* 1 on the simulator */
} kvpool_info;

#ifndef KVPOOL_NO_PROTOTYPES

int kvpool_abi_version(void);

/* The calling thread's message of its last failed call, NUL-terminated and
 * truncated to cap bytes; returns the message's full length (0: none). */
size_t kvpool_last_error(char *buf, size_t cap);

/* Connects to the agent, opens a session for the device and layout, maps
 * and registers the granted chunks. On the simulator the regions' memory is
 * the caller's own host memory, registered as simulated device memory
 * until kvpool_close. */
int kvpool_open(const kvpool_options *opts, kvpool_handle *out);

/* Waits for pending copies, ends the session and frees the handle. */
int kvpool_close(kvpool_handle h);

/* offload_stream: 1 stored (copies enqueued), 0 the pool cannot hold every
 * page (nothing changed), negative on error. */
int kvpool_offload(kvpool_handle h, const char *rid, size_t rid_len, const char *label, size_t label_len,
                   const int32_t *gpu_pages, int64_t n, int64_t stored_len, int64_t position, int64_t released);

/* reload_stream: copies the stream's host pages onto gpu_pages[0..n), frees
 * the stream, writes its host page indices to host_pages (capacity cap) and
 * its metadata to meta. */
int kvpool_reload(kvpool_handle h, const char *rid, size_t rid_len, const char *label, size_t label_len,
                  const int32_t *gpu_pages, int64_t n, int32_t *host_pages, int64_t cap, kvpool_stream_meta *meta);

int kvpool_discard(kvpool_handle h, const char *rid, size_t rid_len, const char *label, size_t label_len);
int kvpool_remove_request(kvpool_handle h, const char *rid, size_t rid_len);
/* 1 when rid has a stream, 0 when not, negative on error. */
int kvpool_is_offloaded(kvpool_handle h, const char *rid, size_t rid_len);

/* The labels of rid in offload order, concatenated into buf; label i ends at
 * ends[i]. *n_labels and *bytes receive the sizes needed; when buf or ends
 * are too small the call returns KVPOOL_ERR_BUFFER_TOO_SMALL and writes
 * nothing else. */
int kvpool_labels(kvpool_handle h, const char *rid, size_t rid_len, char *buf, size_t cap, size_t *ends,
                  size_t ends_cap, size_t *n_labels, size_t *bytes);

int kvpool_num_pages(kvpool_handle h, const char *rid, size_t rid_len, const char *label, size_t label_len,
                     int64_t *out);
int kvpool_num_free_pages(kvpool_handle h, int64_t *out);

/* Makes later work on stream (a CUstream; 0 the default stream) wait for
 * every copy enqueued so far, both directions. Does not block. */
int kvpool_sync(kvpool_handle h, uint64_t stream);

/* Blocks until every copy enqueued so far has completed. */
int kvpool_synchronize(kvpool_handle h);

/* Blocks until the work on stream (0: the default stream) has completed
 * (cuStreamSynchronize): what an engine without a CUDA runtime of its own,
 * or a test on the simulator, uses to wait for what kvpool_sync ordered. */
int kvpool_stream_synchronize(kvpool_handle h, uint64_t stream);

int kvpool_info_get(kvpool_handle h, kvpool_info *out);

/* Where the session's chunks lie relative to its GPU. out->struct_size must
 * be sizeof(kvpool_locality). */
int kvpool_locality_get(kvpool_handle h, kvpool_locality *out);

/* The NUMA node of each of the session's chunks, in page order, into
 * numa[0..cap) (-1 unknown); *n receives the count. When cap is smaller
 * than the count the call returns KVPOOL_ERR_BUFFER_TOO_SMALL and writes
 * only *n. */
int kvpool_chunk_numa(kvpool_handle h, int32_t *numa, int64_t cap, int64_t *n);

/* Drops the connection without ending the session, as a socket failure
 * would; the next call reconnects and resumes. For tests. */
int kvpool_disconnect(kvpool_handle h);

#endif /* KVPOOL_NO_PROTOTYPES */

#ifdef __cplusplus
}
#endif

#endif /* KVPOOL_H */
