// fakecuda is a stand-in for libcuda.so.1 that the loader tests build with
// gcc. It exports the few entry points kvpool resolves, answers with the
// driver version and errors chosen at compile time, and moves bytes with
// memcpy (its "device memory" is host memory), so the real dlopen,
// cuGetProcAddress and call paths run without a GPU. Every call that needs a
// context checks that the primary context is current on the calling thread.
// Calls that tests inspect append one line to FAKE_LOG.
//
// Compile-time knobs:
//   FAKE_VERSION       driver version (default 13000)
//   FAKE_NO_GETPROC    do not export cuGetProcAddress_v2
//   FAKE_MISSING       name of one symbol cuGetProcAddress does not find
//   FAKE_INIT_RESULT   what cuInit returns (default 0)
//   FAKE_DEVICES       device count (default 1)
//   FAKE_LOG           path of the call log (a string literal)
//   FAKE_REGISTER_US   microseconds each cuMemHostRegister takes (default 0)
//   FAKE_BATCH_FAIL_AT the batch call (1, 2, ...) that fails without copying
//   FAKE_MODULE_RESULT what cuModuleLoadData returns (default 0; 218 is
//                      CUDA_ERROR_INVALID_PTX, a driver that cannot compile it)
//   FAKE_LAUNCH_FAIL_AT the cuLaunchKernel call (1, 2, ...) that fails
//
// The copy kernel (cuModuleLoadData of pkg/cudart's PTX, cuLaunchKernel) is
// run on the CPU: each block's run is memcpy'd as the kernel would move it.
// A run outside device allocations and registered host memory is what
// faults on a GPU; here, as there, it makes the context unusable: every
// later call that needs it returns CUDA_ERROR_ILLEGAL_ADDRESS (700).

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef FAKE_VERSION
#define FAKE_VERSION 13000
#endif
#ifndef FAKE_INIT_RESULT
#define FAKE_INIT_RESULT 0
#endif
#ifndef FAKE_DEVICES
#define FAKE_DEVICES 1
#endif
#ifndef FAKE_MISSING
#define FAKE_MISSING ""
#endif

#define EXPORT __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum {
	OK = 0,
	INVALID_VALUE = 1,
	OUT_OF_MEMORY = 2,
	NOT_INITIALIZED = 3,
	NO_DEVICE = 100,
	INVALID_DEVICE = 101,
	INVALID_CONTEXT = 201,
	INVALID_HANDLE = 400,
	NOT_FOUND = 500,
	INVALID_PTX = 218,
	NOT_READY = 600,
	ILLEGAL_ADDRESS = 700,
	ALREADY_REGISTERED = 712,
	NOT_REGISTERED = 713,
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int initialized;
static __thread void *current;
static char primary[FAKE_DEVICES > 0 ? FAKE_DEVICES : 1]; // context handles
static int retained[FAKE_DEVICES > 0 ? FAKE_DEVICES : 1];

static void logf_(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
#include <stdarg.h>
static void logf_(const char *fmt, ...) {
#ifdef FAKE_LOG
	pthread_mutex_lock(&mu);
	FILE *f = fopen(FAKE_LOG, "a");
	if (f) {
		va_list ap;
		va_start(ap, fmt);
		vfprintf(f, fmt, ap);
		va_end(ap);
		fputc('\n', f);
		fclose(f);
	}
	pthread_mutex_unlock(&mu);
#else
	(void)fmt;
#endif
}

static int faulted; // a kernel touched a bad address: the context is lost

static CUresult need_ctx(void) {
	if (!initialized) return NOT_INITIALIZED;
	if (faulted) return ILLEGAL_ADDRESS;
	for (int i = 0; i < FAKE_DEVICES; i++)
		if (current == &primary[i] && retained[i]) return OK;
	return INVALID_CONTEXT;
}

#define CTX()                             \
	do {                                  \
		CUresult r_ = need_ctx();         \
		if (r_ != OK) return r_;          \
	} while (0)

EXPORT CUresult cuDriverGetVersion(int *v) {
	if (!v) return INVALID_VALUE;
	*v = FAKE_VERSION;
	return OK;
}

static CUresult fake_init(unsigned flags) {
	if (flags != 0) return INVALID_VALUE;
	if (FAKE_INIT_RESULT != 0) return FAKE_INIT_RESULT;
	initialized = 1;
	return OK;
}

static const struct {
	int code;
	const char *name, *text;
} errs[] = {
    {OK, "CUDA_SUCCESS", "no error"},
    {INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {NOT_INITIALIZED, "CUDA_ERROR_NOT_INITIALIZED", "initialization error"},
    {NO_DEVICE, "CUDA_ERROR_NO_DEVICE", "no CUDA-capable device is detected"},
    {INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {INVALID_HANDLE, "CUDA_ERROR_INVALID_HANDLE", "invalid resource handle"},
    {NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {INVALID_PTX, "CUDA_ERROR_INVALID_PTX", "a PTX JIT compilation failed"},
    {NOT_READY, "CUDA_ERROR_NOT_READY", "device not ready"},
    {ILLEGAL_ADDRESS, "CUDA_ERROR_ILLEGAL_ADDRESS", "an illegal memory access was encountered"},
    {ALREADY_REGISTERED, "CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED", "part or all of the requested memory range is already mapped"},
    {NOT_REGISTERED, "CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED", "pointer does not correspond to a registered memory region"},
};

static CUresult fake_error_name(CUresult r, const char **s) {
	for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++)
		if (errs[i].code == r) {
			*s = errs[i].name;
			return OK;
		}
	*s = NULL;
	return INVALID_VALUE;
}

static CUresult fake_error_string(CUresult r, const char **s) {
	for (size_t i = 0; i < sizeof errs / sizeof errs[0]; i++)
		if (errs[i].code == r) {
			*s = errs[i].text;
			return OK;
		}
	*s = NULL;
	return INVALID_VALUE;
}

static CUresult fake_device_count(int *n) {
	if (!initialized) return NOT_INITIALIZED;
	*n = FAKE_DEVICES;
	return OK;
}

static CUresult fake_device_get(int *d, int ordinal) {
	if (!initialized) return NOT_INITIALIZED;
	if (ordinal < 0 || ordinal >= FAKE_DEVICES) return INVALID_DEVICE;
	*d = ordinal;
	return OK;
}

static CUresult fake_device_name(char *buf, int n, int d) {
	if (d < 0 || d >= FAKE_DEVICES) return INVALID_DEVICE;
	snprintf(buf, n, "Fake GPU %d", d);
	return OK;
}

// fake_device_uuid gives device d the bytes "fakecuda" followed by d,
// big-endian: GPU-66616b65-6375-6461-0000-00000000000<d>.
static CUresult fake_device_uuid(unsigned char *uuid, int d) {
	if (!initialized) return NOT_INITIALIZED;
	if (d < 0 || d >= FAKE_DEVICES) return INVALID_DEVICE;
	memcpy(uuid, "fakecuda", 8);
	for (int i = 0; i < 8; i++) uuid[8 + i] = (unsigned char)((uint64_t)d >> (8 * (7 - i)));
	return OK;
}

static CUresult fake_retain(void **ctx, int d) {
	if (!initialized) return NOT_INITIALIZED;
	if (d < 0 || d >= FAKE_DEVICES) return INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	retained[d]++;
	pthread_mutex_unlock(&mu);
	*ctx = &primary[d];
	return OK;
}

static CUresult fake_release(int d) {
	if (d < 0 || d >= FAKE_DEVICES || !retained[d]) return INVALID_DEVICE;
	pthread_mutex_lock(&mu);
	retained[d]--;
	pthread_mutex_unlock(&mu);
	logf_("cuDevicePrimaryCtxRelease %d", d);
	return OK;
}

static CUresult fake_get_current(void **ctx) {
	*ctx = current;
	return OK;
}

static CUresult fake_set_current(void *ctx) {
	current = ctx;
	return OK;
}

// Device memory: malloc'd blocks, looked up so that bad frees fail.
#define MAXA 1024
static void *allocs[MAXA];
static size_t alloc_sizes[MAXA];

static CUresult fake_mem_alloc(CUdeviceptr *p, size_t n) {
	CTX();
	if (n == 0) return INVALID_VALUE;
	if (n > (1ull << 30)) return OUT_OF_MEMORY;
	void *b = malloc(n);
	if (!b) return OUT_OF_MEMORY;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++)
		if (!allocs[i]) {
			allocs[i] = b;
			alloc_sizes[i] = n;
			pthread_mutex_unlock(&mu);
			*p = (CUdeviceptr)(uintptr_t)b;
			return OK;
		}
	pthread_mutex_unlock(&mu);
	free(b);
	return OUT_OF_MEMORY;
}

static CUresult fake_mem_free(CUdeviceptr p) {
	CTX();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++)
		if (allocs[i] && (uintptr_t)allocs[i] == p) {
			free(allocs[i]);
			allocs[i] = NULL;
			pthread_mutex_unlock(&mu);
			return OK;
		}
	pthread_mutex_unlock(&mu);
	return INVALID_VALUE;
}

static CUresult fake_htod(CUdeviceptr dst, const void *src, size_t n) {
	CTX();
	memcpy((void *)(uintptr_t)dst, src, n);
	return OK;
}

static CUresult fake_dtoh(void *dst, CUdeviceptr src, size_t n) {
	CTX();
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return OK;
}

// Host registrations.
#define MAXR 256
static struct {
	uintptr_t base;
	size_t n;
} regs[MAXR];

static CUresult fake_host_register(void *p, size_t n, unsigned flags) {
	CTX();
#ifdef FAKE_REGISTER_US
	usleep(FAKE_REGISTER_US);
#endif
	uintptr_t b = (uintptr_t)p;
	pthread_mutex_lock(&mu);
	int free_slot = -1;
	for (int i = 0; i < MAXR; i++) {
		if (!regs[i].n) {
			if (free_slot < 0) free_slot = i;
			continue;
		}
		if (b < regs[i].base + regs[i].n && regs[i].base < b + n) {
			pthread_mutex_unlock(&mu);
			return ALREADY_REGISTERED;
		}
	}
	if (free_slot < 0) {
		pthread_mutex_unlock(&mu);
		return OUT_OF_MEMORY;
	}
	regs[free_slot].base = b;
	regs[free_slot].n = n;
	pthread_mutex_unlock(&mu);
	logf_("cuMemHostRegister bytes=%zu flags=%u", n, flags);
	return OK;
}

static CUresult fake_host_unregister(void *p) {
	CTX();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXR; i++)
		if (regs[i].n && regs[i].base == (uintptr_t)p) {
			size_t n = regs[i].n;
			regs[i].n = 0;
			pthread_mutex_unlock(&mu);
			logf_("cuMemHostUnregister bytes=%zu", n);
			return OK;
		}
	pthread_mutex_unlock(&mu);
	return NOT_REGISTERED;
}

// Streams and events are small handles; 0 is the legacy default stream.
#define MAXS 256
static int streams[MAXS], events[MAXS];
#define HANDLE(i) ((void *)(uintptr_t)(0x5000 + (i)))
#define INDEX(h) ((int)((uintptr_t)(h)-0x5000))

static int live(int *table, void *h) {
	int i = INDEX(h);
	return i >= 0 && i < MAXS && table[i];
}

static CUresult make(int *table, void **h) {
	pthread_mutex_lock(&mu);
	for (int i = 1; i < MAXS; i++)
		if (!table[i]) {
			table[i] = 1;
			pthread_mutex_unlock(&mu);
			*h = HANDLE(i);
			return OK;
		}
	pthread_mutex_unlock(&mu);
	return OUT_OF_MEMORY;
}

static CUresult drop(int *table, void *h) {
	pthread_mutex_lock(&mu);
	int ok = live(table, h);
	if (ok) table[INDEX(h)] = 0;
	pthread_mutex_unlock(&mu);
	return ok ? OK : INVALID_HANDLE;
}

static CUresult check_stream(void *s) { return s == NULL || live(streams, s) ? OK : INVALID_HANDLE; }

static CUresult fake_stream_create(void **s, unsigned flags) {
	CTX();
	logf_("cuStreamCreate flags=%u", flags);
	return make(streams, s);
}

static CUresult fake_stream_create_prio(void **s, unsigned flags, int priority) {
	CTX();
	if (priority < -5 || priority > 0) return INVALID_VALUE;
	logf_("cuStreamCreate flags=%u priority=%d", flags, priority);
	return make(streams, s);
}

static CUresult fake_priority_range(int *least, int *greatest) {
	CTX();
	*least = 0;
	*greatest = -5;
	return OK;
}

static CUresult fake_stream_destroy(void *s) {
	CTX();
	return drop(streams, s);
}

static CUresult fake_stream_sync(void *s) {
	CTX();
	logf_("cuStreamSynchronize");
	return check_stream(s);
}

static CUresult fake_event_create(void **e, unsigned flags) {
	CTX();
	logf_("cuEventCreate flags=%u", flags);
	return make(events, e);
}

static CUresult fake_event_destroy(void *e) {
	CTX();
	return drop(events, e);
}

static CUresult fake_event_record(void *e, void *s) {
	CTX();
	if (!live(events, e)) return INVALID_HANDLE;
	return check_stream(s);
}

static CUresult fake_event_sync(void *e) {
	CTX();
	return live(events, e) ? OK : INVALID_HANDLE;
}

static CUresult fake_event_query(void *e) {
	CTX();
	return live(events, e) ? OK : INVALID_HANDLE;
}

static CUresult fake_stream_wait_event(void *s, void *e, unsigned flags) {
	CTX();
	if (flags != 0 || !live(events, e)) return INVALID_HANDLE;
	return check_stream(s);
}

static CUresult fake_htod_async(CUdeviceptr dst, const void *src, size_t n, void *s) {
	CTX();
	if (check_stream(s) != OK) return INVALID_HANDLE;
	logf_("cuMemcpyHtoDAsync bytes=%zu stream=%s", n, s ? "own" : "default");
	memcpy((void *)(uintptr_t)dst, src, n);
	return OK;
}

static CUresult fake_dtoh_async(void *dst, CUdeviceptr src, size_t n, void *s) {
	CTX();
	if (check_stream(s) != OK) return INVALID_HANDLE;
	logf_("cuMemcpyDtoHAsync bytes=%zu stream=%s", n, s ? "own" : "default");
	memcpy(dst, (const void *)(uintptr_t)src, n);
	return OK;
}

// mapped reports whether [p, p+n) lies in one device allocation or one
// registered host range: what a GPU may address.
static int mapped(uintptr_t p, size_t n) {
	int ok = 0;
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA && !ok; i++)
		if (allocs[i] && p >= (uintptr_t)allocs[i] && p + n <= (uintptr_t)allocs[i] + alloc_sizes[i]) ok = 1;
	for (int i = 0; i < MAXR && !ok; i++)
		if (regs[i].n && p >= regs[i].base && p + n <= regs[i].base + regs[i].n) ok = 1;
	pthread_mutex_unlock(&mu);
	return ok;
}

static CUresult fake_address_range(CUdeviceptr *base, size_t *size, CUdeviceptr p) {
	CTX();
	pthread_mutex_lock(&mu);
	for (int i = 0; i < MAXA; i++)
		if (allocs[i] && p >= (uintptr_t)allocs[i] && p < (uintptr_t)allocs[i] + alloc_sizes[i]) {
			if (base) *base = (uintptr_t)allocs[i];
			if (size) *size = alloc_sizes[i];
			pthread_mutex_unlock(&mu);
			return OK;
		}
	pthread_mutex_unlock(&mu);
	return NOT_FOUND;
}

// The copy kernel's module: one, holding kv_copy_runs.
static char module, function;

static CUresult fake_module_load(void **m, const void *image) {
	CTX();
	const char *ptx = image;
	logf_("cuModuleLoadData bytes=%zu", strlen(ptx));
#ifdef FAKE_MODULE_RESULT
	if (FAKE_MODULE_RESULT != 0) return FAKE_MODULE_RESULT;
#endif
	if (strstr(ptx, ".entry kv_copy_runs(") == NULL || strstr(ptx, "runs[32640]") == NULL) return INVALID_PTX;
	*m = &module;
	return OK;
}

static CUresult fake_module_unload(void *m) {
	CTX();
	logf_("cuModuleUnload");
	return m == &module ? OK : INVALID_HANDLE;
}

static CUresult fake_module_function(void **f, void *m, const char *name) {
	CTX();
	if (m != &module) return INVALID_HANDLE;
	if (strcmp(name, "kv_copy_runs") != 0) return NOT_FOUND;
	*f = &function;
	return OK;
}

typedef struct {
	uint64_t dst, src, bytes;
} run;

static CUresult fake_launch(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                            unsigned shared, void *s, void **params, void **extra) {
	CTX();
	if (f != &function || check_stream(s) != OK) return INVALID_HANDLE;
	if (gx == 0 || gx > 1360 || gy != 1 || gz != 1 || bx != 256 || by != 1 || bz != 1 || shared != 0 ||
	    params == NULL || extra != NULL)
		return INVALID_VALUE;
#ifdef FAKE_LAUNCH_FAIL_AT
	static int launches;
	if (++launches == FAKE_LAUNCH_FAIL_AT) {
		logf_("cuLaunchKernel failed runs=%u", gx);
		return INVALID_VALUE;
	}
#endif
	const run *r = params[0];
	size_t total = 0;
	for (unsigned i = 0; i < gx; i++) {
		if ((r[i].dst | r[i].src | r[i].bytes) % 16 != 0 || !mapped(r[i].dst, r[i].bytes) || !mapped(r[i].src, r[i].bytes)) {
			logf_("cuLaunchKernel faulted run=%u", i);
			faulted = 1;
			return OK; // a kernel's fault shows later, at the next call
		}
		memcpy((void *)(uintptr_t)r[i].dst, (const void *)(uintptr_t)r[i].src, r[i].bytes);
		total += r[i].bytes;
	}
	logf_("cuLaunchKernel runs=%u bytes=%zu stream=%s", gx, total, s ? "own" : "default");
	return OK;
}

typedef struct {
	int type, id;
} loc;
typedef struct {
	int order;
	loc src, dst;
	unsigned flags;
} attrs;

static CUresult batch(const char *abi, CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes,
                      size_t count, attrs *a, size_t *idxs, size_t nattrs, void *s) {
	CTX();
	// The batch call rejects the legacy default stream.
	if (s == NULL || !live(streams, s)) return INVALID_HANDLE;
	if (count == 0 || nattrs != 1 || idxs[0] != 0 || a[0].order != 1) return INVALID_VALUE;
#ifdef FAKE_BATCH_FAIL_AT
	static int batches;
	if (++batches == FAKE_BATCH_FAIL_AT) {
		logf_("cuMemcpyBatchAsync failed count=%zu", count);
		return INVALID_VALUE;
	}
#endif
	// As the driver does, refuse a copy whose sides are neither device
	// allocations nor registered host memory, before copying anything.
	for (size_t i = 0; i < count; i++)
		if (!mapped(dsts[i], sizes[i]) || !mapped(srcs[i], sizes[i])) return INVALID_VALUE;
	size_t total = 0;
	for (size_t i = 0; i < count; i++) {
		memcpy((void *)(uintptr_t)dsts[i], (const void *)(uintptr_t)srcs[i], sizes[i]);
		total += sizes[i];
	}
	logf_("cuMemcpyBatchAsync abi=%s count=%zu bytes=%zu", abi, count, total);
	return OK;
}

__attribute__((unused)) static CUresult fake_batch_12080(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                 attrs *a, size_t *idxs, size_t nattrs, size_t *fail_idx, void *s) {
	if (fail_idx == NULL) return INVALID_VALUE;
	return batch("12080", dsts, srcs, sizes, count, a, idxs, nattrs, s);
}

__attribute__((unused)) static CUresult fake_batch_13000(CUdeviceptr *dsts, CUdeviceptr *srcs, size_t *sizes, size_t count,
                                 attrs *a, size_t *idxs, size_t nattrs, void *s) {
	return batch("13000", dsts, srcs, sizes, count, a, idxs, nattrs, s);
}

struct host_call {
	void (*fn)(void *);
	void *user;
};

static void *host_thread(void *p) {
	struct host_call c = *(struct host_call *)p;
	free(p);
	c.fn(c.user);
	return NULL;
}

// cuLaunchHostFunc runs fn on a thread the Go runtime has never seen, as
// the driver does.
static CUresult fake_launch_host_func(void *s, void (*fn)(void *), void *user) {
	CTX();
	if (check_stream(s) != OK || fn == NULL) return INVALID_HANDLE;
	struct host_call *c = malloc(sizeof *c);
	c->fn = fn;
	c->user = user;
	pthread_t t;
	if (pthread_create(&t, NULL, host_thread, c) != 0) {
		free(c);
		return OUT_OF_MEMORY;
	}
	pthread_detach(t);
	return OK;
}

__attribute__((unused)) static const struct {
	const char *name;
	void *fn;
} table[] = {
    {"cuInit", (void *)fake_init},
    {"cuGetErrorName", (void *)fake_error_name},
    {"cuGetErrorString", (void *)fake_error_string},
    {"cuDeviceGetCount", (void *)fake_device_count},
    {"cuDeviceGet", (void *)fake_device_get},
    {"cuDeviceGetName", (void *)fake_device_name},
    {"cuDeviceGetUuid", (void *)fake_device_uuid},
    {"cuDevicePrimaryCtxRetain", (void *)fake_retain},
    {"cuDevicePrimaryCtxRelease", (void *)fake_release},
    {"cuCtxGetCurrent", (void *)fake_get_current},
    {"cuCtxSetCurrent", (void *)fake_set_current},
    {"cuMemAlloc", (void *)fake_mem_alloc},
    {"cuMemFree", (void *)fake_mem_free},
    {"cuMemcpyHtoD", (void *)fake_htod},
    {"cuMemcpyDtoH", (void *)fake_dtoh},
    {"cuMemHostRegister", (void *)fake_host_register},
    {"cuMemHostUnregister", (void *)fake_host_unregister},
    {"cuStreamCreate", (void *)fake_stream_create},
    {"cuStreamDestroy", (void *)fake_stream_destroy},
    {"cuStreamSynchronize", (void *)fake_stream_sync},
    {"cuEventCreate", (void *)fake_event_create},
    {"cuEventDestroy", (void *)fake_event_destroy},
    {"cuEventRecord", (void *)fake_event_record},
    {"cuEventSynchronize", (void *)fake_event_sync},
    {"cuEventQuery", (void *)fake_event_query},
    {"cuStreamWaitEvent", (void *)fake_stream_wait_event},
    {"cuMemcpyHtoDAsync", (void *)fake_htod_async},
    {"cuMemcpyDtoHAsync", (void *)fake_dtoh_async},
    {"cuLaunchHostFunc", (void *)fake_launch_host_func},
    {"cuModuleLoadData", (void *)fake_module_load},
    {"cuModuleUnload", (void *)fake_module_unload},
    {"cuModuleGetFunction", (void *)fake_module_function},
    {"cuLaunchKernel", (void *)fake_launch},
    {"cuMemGetAddressRange", (void *)fake_address_range},
    {"cuStreamCreateWithPriority", (void *)fake_stream_create_prio},
    {"cuCtxGetStreamPriorityRange", (void *)fake_priority_range},
};

#ifndef FAKE_NO_GETPROC
EXPORT CUresult cuGetProcAddress_v2(const char *symbol, void **pfn, int version, uint64_t flags,
                                    int *status) {
	*pfn = NULL;
	if (flags != 0) return INVALID_VALUE;
	if (strcmp(symbol, FAKE_MISSING) == 0) {
		if (status) *status = 1; // CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND
		return NOT_FOUND;
	}
	if (strcmp(symbol, "cuMemcpyBatchAsync") == 0) {
		logf_("cuGetProcAddress cuMemcpyBatchAsync version=%d", version);
		if (FAKE_VERSION < 12080 || version < 12080) {
			if (status) *status = 2; // CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT
			return NOT_FOUND;
		}
		*pfn = version >= 13000 ? (void *)fake_batch_13000 : (void *)fake_batch_12080;
		if (status) *status = 0;
		return OK;
	}
	for (size_t i = 0; i < sizeof table / sizeof table[0]; i++)
		if (strcmp(symbol, table[i].name) == 0) {
			*pfn = table[i].fn;
			if (status) *status = 0;
			return OK;
		}
	if (status) *status = 1;
	return NOT_FOUND;
}
#endif
