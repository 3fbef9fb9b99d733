//go:build cgo

#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cuda_shim.h"

// Constants from the CUDA driver API.
enum {
	KV_MEMCPY_SRC_ACCESS_ORDER_STREAM = 1,
	KV_MEM_LOCATION_TYPE_INVALID = 0,
};

typedef struct {
	int type;
	int id;
} kv_mem_location; // CUmemLocation

typedef struct {
	int srcAccessOrder;        // CUmemcpySrcAccessOrder
	kv_mem_location srcLocHint;
	kv_mem_location dstLocHint;
	unsigned int flags;
} kv_memcpy_attributes; // CUmemcpyAttributes (CUDA 12.8 and 13)

typedef kv_result (*get_proc_fn)(const char *, void **, int, uint64_t, int *);

extern void kvpoolHostFn(uintptr_t);

static void kv_host_trampoline(void *user) { kvpoolHostFn((uintptr_t)user); }

static char *kv_strdup_printf(const char *format, const char *a, const char *b) {
	size_t n = strlen(format) + strlen(a) + (b ? strlen(b) : 0) + 1;
	char *s = malloc(n);
	if (s) snprintf(s, n, format, a, b ? b : "");
	return s;
}

kv_api *kv_open(const char *path, char **err) {
	void *lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		const char *e = dlerror();
		*err = kv_strdup_printf("dlopen %s: %s", path, e ? e : "unknown error");
		return NULL;
	}
	kv_api *a = calloc(1, sizeof *a);
	if (!a) {
		dlclose(lib);
		*err = kv_strdup_printf("%s%s", "out of memory", NULL);
		return NULL;
	}
	a->lib = lib;
	// cuDriverGetVersion is callable before cuInit and has had one ABI
	// since CUDA 2.2; cuGetProcAddress_v2 exists from CUDA 12.0.
	a->driverGetVersion = dlsym(lib, "cuDriverGetVersion");
	if (!a->driverGetVersion) {
		*err = kv_strdup_printf("dlsym cuDriverGetVersion in %s%s", path, NULL);
		dlclose(lib);
		free(a);
		return NULL;
	}
	a->getProcAddress = dlsym(lib, "cuGetProcAddress_v2");
	return a;
}

void kv_close(kv_api *a) {
	dlclose(a->lib);
	free(a);
}

kv_result kv_driver_version(kv_api *a, int *v) {
	return ((kv_result(*)(int *))a->driverGetVersion)(v);
}

// kv_bind resolves every entry point at the CUDA version whose ABI this
// file declares. It needs a->driver_version and a->getProcAddress.
kv_result kv_bind(kv_api *a, const char **failed, int *status) {
	get_proc_fn gp = (get_proc_fn)a->getProcAddress;
	kv_result r;
#define KV_BIND(field, name, version)                               \
	do {                                                             \
		*status = 0;                                                 \
		a->field = NULL;                                             \
		r = gp(name, &a->field, version, 0, status);                 \
		if (r != 0 || a->field == NULL) {                            \
			*failed = name;                                          \
			return r != 0 ? r : 500; /* CUDA_ERROR_NOT_FOUND */      \
		}                                                            \
	} while (0)
	KV_BIND(init, "cuInit", 12000);
	KV_BIND(getErrorName, "cuGetErrorName", 12000);
	KV_BIND(getErrorString, "cuGetErrorString", 12000);
	KV_BIND(deviceGetCount, "cuDeviceGetCount", 12000);
	KV_BIND(deviceGet, "cuDeviceGet", 12000);
	KV_BIND(deviceGetName, "cuDeviceGetName", 12000);
	// At 12000 cuGetProcAddress hands back cuDeviceGetUuid_v2 (11.4 on),
	// whose UUID is the one NVML and nvidia-smi report.
	KV_BIND(deviceGetUuid, "cuDeviceGetUuid", 12000);
	KV_BIND(primaryCtxRetain, "cuDevicePrimaryCtxRetain", 12000);
	KV_BIND(primaryCtxRelease, "cuDevicePrimaryCtxRelease", 12000);
	KV_BIND(ctxGetCurrent, "cuCtxGetCurrent", 12000);
	KV_BIND(ctxSetCurrent, "cuCtxSetCurrent", 12000);
	KV_BIND(memAlloc, "cuMemAlloc", 12000);
	KV_BIND(memFree, "cuMemFree", 12000);
	KV_BIND(memcpyHtoD, "cuMemcpyHtoD", 12000);
	KV_BIND(memcpyDtoH, "cuMemcpyDtoH", 12000);
	KV_BIND(memHostRegister, "cuMemHostRegister", 12000);
	KV_BIND(memHostUnregister, "cuMemHostUnregister", 12000);
	KV_BIND(streamCreate, "cuStreamCreate", 12000);
	KV_BIND(streamDestroy, "cuStreamDestroy", 12000);
	KV_BIND(streamSynchronize, "cuStreamSynchronize", 12000);
	KV_BIND(eventCreate, "cuEventCreate", 12000);
	KV_BIND(eventDestroy, "cuEventDestroy", 12000);
	KV_BIND(eventRecord, "cuEventRecord", 12000);
	KV_BIND(eventSynchronize, "cuEventSynchronize", 12000);
	KV_BIND(eventQuery, "cuEventQuery", 12000);
	KV_BIND(streamWaitEvent, "cuStreamWaitEvent", 12000);
	KV_BIND(memcpyHtoDAsync, "cuMemcpyHtoDAsync", 12000);
	KV_BIND(memcpyDtoHAsync, "cuMemcpyDtoHAsync", 12000);
	KV_BIND(launchHostFunc, "cuLaunchHostFunc", 12000);
#undef KV_BIND

	// cuMemcpyBatchAsync: 12.8 has a failIdx parameter that 13.0 removed.
	// Ask for the ABI that matches the driver, and declare that one.
	a->memcpyBatchAsync = NULL;
	a->batch_abi = 0;
	int want = a->driver_version >= 13000 ? 13000 : a->driver_version >= 12080 ? 12080 : 0;
	if (want) {
		int st = 0;
		void *fn = NULL;
		if (gp("cuMemcpyBatchAsync", &fn, want, 0, &st) == 0 && st == 0 && fn) {
			a->memcpyBatchAsync = fn;
			a->batch_abi = want;
		}
	}
	*failed = NULL;
	return 0;
}

kv_result kv_bind_kernel(kv_api *a, const char **failed) {
	get_proc_fn gp = (get_proc_fn)a->getProcAddress;
	struct {
		void **field;
		const char *name;
	} want[] = {
	    {&a->moduleLoadData, "cuModuleLoadData"},
	    {&a->moduleUnload, "cuModuleUnload"},
	    {&a->moduleGetFunction, "cuModuleGetFunction"},
	    {&a->launchKernel, "cuLaunchKernel"},
	    {&a->memGetAddressRange, "cuMemGetAddressRange"},
	    {&a->streamCreateWithPriority, "cuStreamCreateWithPriority"},
	    {&a->ctxGetStreamPriorityRange, "cuCtxGetStreamPriorityRange"},
	};
	for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
		int status = 0;
		*want[i].field = NULL;
		kv_result r = gp(want[i].name, want[i].field, 12000, 0, &status);
		if (r != 0 || *want[i].field == NULL) {
			for (size_t j = 0; j <= i; j++) *want[j].field = NULL;
			*failed = want[i].name;
			return r != 0 ? r : 500; // CUDA_ERROR_NOT_FOUND
		}
	}
	*failed = NULL;
	return 0;
}

const char *kv_error_name(kv_api *a, kv_result r) {
	const char *s = NULL;
	if (a->getErrorName && ((kv_result(*)(kv_result, const char **))a->getErrorName)(r, &s) == 0)
		return s;
	return NULL;
}

const char *kv_error_string(kv_api *a, kv_result r) {
	const char *s = NULL;
	if (a->getErrorString && ((kv_result(*)(kv_result, const char **))a->getErrorString)(r, &s) == 0)
		return s;
	return NULL;
}

kv_result kv_init(kv_api *a) { return ((kv_result(*)(unsigned))a->init)(0); }

kv_result kv_device_count(kv_api *a, int *n) { return ((kv_result(*)(int *))a->deviceGetCount)(n); }

kv_result kv_device_get(kv_api *a, int ordinal, kv_device *d) {
	return ((kv_result(*)(kv_device *, int))a->deviceGet)(d, ordinal);
}

kv_result kv_device_name(kv_api *a, kv_device d, char *buf, int n) {
	return ((kv_result(*)(char *, int, kv_device))a->deviceGetName)(buf, n, d);
}

kv_result kv_device_uuid(kv_api *a, kv_device d, unsigned char *out) {
	return ((kv_result(*)(unsigned char *, kv_device))a->deviceGetUuid)(out, d);
}

kv_result kv_ctx_retain(kv_api *a, kv_device d, kv_context *ctx) {
	return ((kv_result(*)(kv_context *, kv_device))a->primaryCtxRetain)(ctx, d);
}

kv_result kv_ctx_release(kv_api *a, kv_device d) {
	return ((kv_result(*)(kv_device))a->primaryCtxRelease)(d);
}

static kv_result kv_current(kv_api *a, kv_context ctx) {
	kv_context cur = NULL;
	kv_result r = ((kv_result(*)(kv_context *))a->ctxGetCurrent)(&cur);
	if (r == 0 && cur == ctx) return 0;
	return ((kv_result(*)(kv_context))a->ctxSetCurrent)(ctx);
}

#define KV_CURRENT()                          \
	do {                                      \
		kv_result cr = kv_current(a, ctx);    \
		if (cr != 0) return cr;               \
	} while (0)

kv_result kv_mem_alloc(kv_api *a, kv_context ctx, kv_dptr *p, size_t n) {
	KV_CURRENT();
	return ((kv_result(*)(kv_dptr *, size_t))a->memAlloc)(p, n);
}

kv_result kv_mem_free(kv_api *a, kv_context ctx, kv_dptr p) {
	KV_CURRENT();
	return ((kv_result(*)(kv_dptr))a->memFree)(p);
}

kv_result kv_memcpy_htod(kv_api *a, kv_context ctx, kv_dptr dst, const void *src, size_t n) {
	KV_CURRENT();
	kv_result r = ((kv_result(*)(kv_dptr, const void *, size_t))a->memcpyHtoD)(dst, src, n);
	if (r != 0) return r;
	// From pageable memory, cuMemcpyHtoD may return once the bytes are
	// staged, before the DMA lands, and only the legacy default stream is
	// ordered behind it. Wait for it, so that the copy is complete on
	// return as the Device interface promises.
	return ((kv_result(*)(void *))a->streamSynchronize)(NULL);
}

kv_result kv_memcpy_dtoh(kv_api *a, kv_context ctx, void *dst, kv_dptr src, size_t n) {
	KV_CURRENT();
	return ((kv_result(*)(void *, kv_dptr, size_t))a->memcpyDtoH)(dst, src, n);
}

kv_result kv_host_register(kv_api *a, kv_context ctx, uint64_t p, size_t n, unsigned flags) {
	KV_CURRENT();
	return ((kv_result(*)(void *, size_t, unsigned))a->memHostRegister)((void *)(uintptr_t)p, n, flags);
}

kv_result kv_host_unregister(kv_api *a, kv_context ctx, uint64_t p) {
	KV_CURRENT();
	return ((kv_result(*)(void *))a->memHostUnregister)((void *)(uintptr_t)p);
}

typedef void *cu_handle; // CUstream, CUevent

kv_result kv_stream_create(kv_api *a, kv_context ctx, kv_stream *s, unsigned flags, int priority) {
	KV_CURRENT();
	cu_handle h = NULL;
	kv_result r;
	if (priority != 0)
		r = ((kv_result(*)(cu_handle *, unsigned, int))a->streamCreateWithPriority)(&h, flags, priority);
	else
		r = ((kv_result(*)(cu_handle *, unsigned))a->streamCreate)(&h, flags);
	*s = (kv_stream)h;
	return r;
}

kv_result kv_greatest_priority(kv_api *a, kv_context ctx, int *p) {
	KV_CURRENT();
	int least = 0;
	return ((kv_result(*)(int *, int *))a->ctxGetStreamPriorityRange)(&least, p);
}

kv_result kv_stream_destroy(kv_api *a, kv_context ctx, kv_stream s) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle))a->streamDestroy)((cu_handle)s);
}

kv_result kv_stream_synchronize(kv_api *a, kv_context ctx, kv_stream s) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle))a->streamSynchronize)((cu_handle)s);
}

kv_result kv_event_create(kv_api *a, kv_context ctx, kv_event *e, unsigned flags) {
	KV_CURRENT();
	cu_handle h = NULL;
	kv_result r = ((kv_result(*)(cu_handle *, unsigned))a->eventCreate)(&h, flags);
	*e = (kv_event)h;
	return r;
}

kv_result kv_event_destroy(kv_api *a, kv_context ctx, kv_event e) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle))a->eventDestroy)((cu_handle)e);
}

kv_result kv_event_record(kv_api *a, kv_context ctx, kv_event e, kv_stream s) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle, cu_handle))a->eventRecord)((cu_handle)e, (cu_handle)s);
}

kv_result kv_event_synchronize(kv_api *a, kv_context ctx, kv_event e) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle))a->eventSynchronize)((cu_handle)e);
}

kv_result kv_event_query(kv_api *a, kv_context ctx, kv_event e) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle))a->eventQuery)((cu_handle)e);
}

kv_result kv_stream_wait_event(kv_api *a, kv_context ctx, kv_stream s, kv_event e) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle, cu_handle, unsigned))a->streamWaitEvent)((cu_handle)s, (cu_handle)e, 0);
}

kv_result kv_launch_host_func(kv_api *a, kv_context ctx, kv_stream s, uintptr_t handle) {
	KV_CURRENT();
	return ((kv_result(*)(cu_handle, void (*)(void *), void *))a->launchHostFunc)(
	    (cu_handle)s, kv_host_trampoline, (void *)handle);
}

typedef kv_result (*batch12_fn)(kv_dptr *, kv_dptr *, size_t *, size_t, kv_memcpy_attributes *,
                                size_t *, size_t, size_t *, cu_handle);
typedef kv_result (*batch13_fn)(kv_dptr *, kv_dptr *, size_t *, size_t, kv_memcpy_attributes *,
                                size_t *, size_t, cu_handle);

kv_result kv_memcpy(kv_api *a, kv_context ctx, const kv_copy *c, size_t n, int dtoh,
                    kv_stream s, int use_batch, const char **call, size_t *fail_idx) {
	*call = "cuCtxSetCurrent";
	*fail_idx = 0;
	KV_CURRENT();
	if (use_batch && a->memcpyBatchAsync && n > 0) {
		*call = "cuMemcpyBatchAsync";
		kv_dptr *dsts = malloc(n * sizeof *dsts);
		kv_dptr *srcs = malloc(n * sizeof *srcs);
		size_t *sizes = malloc(n * sizeof *sizes);
		kv_result r = 2; // CUDA_ERROR_OUT_OF_MEMORY
		if (dsts && srcs && sizes) {
			for (size_t i = 0; i < n; i++) {
				dsts[i] = c[i].dst;
				srcs[i] = c[i].src;
				sizes[i] = c[i].bytes;
			}
			kv_memcpy_attributes attr;
			memset(&attr, 0, sizeof attr);
			attr.srcAccessOrder = KV_MEMCPY_SRC_ACCESS_ORDER_STREAM;
			size_t attr_idx = 0;
			if (a->batch_abi == 12080) {
				size_t fi = (size_t)-1;
				r = ((batch12_fn)a->memcpyBatchAsync)(dsts, srcs, sizes, n, &attr, &attr_idx, 1, &fi, (cu_handle)s);
				if (r != 0 && fi != (size_t)-1) *fail_idx = fi;
			} else {
				r = ((batch13_fn)a->memcpyBatchAsync)(dsts, srcs, sizes, n, &attr, &attr_idx, 1, (cu_handle)s);
			}
		}
		free(dsts);
		free(srcs);
		free(sizes);
		return r;
	}
	for (size_t i = 0; i < n; i++) {
		kv_result r;
		if (dtoh) {
			*call = "cuMemcpyDtoHAsync";
			r = ((kv_result(*)(void *, kv_dptr, size_t, cu_handle))a->memcpyDtoHAsync)(
			    (void *)(uintptr_t)c[i].dst, c[i].src, c[i].bytes, (cu_handle)s);
		} else {
			*call = "cuMemcpyHtoDAsync";
			r = ((kv_result(*)(kv_dptr, const void *, size_t, cu_handle))a->memcpyHtoDAsync)(
			    c[i].dst, (const void *)(uintptr_t)c[i].src, c[i].bytes, (cu_handle)s);
		}
		if (r != 0) {
			*fail_idx = i;
			return r;
		}
	}
	return 0;
}

kv_result kv_load_kernel(kv_api *a, kv_context ctx, const char *ptx, const char *name,
                         void **module, void **fn) {
	KV_CURRENT();
	kv_result r = ((kv_result(*)(void **, const void *))a->moduleLoadData)(module, ptx);
	if (r != 0) return r;
	r = ((kv_result(*)(void **, void *, const char *))a->moduleGetFunction)(fn, *module, name);
	if (r != 0) {
		((kv_result(*)(void *))a->moduleUnload)(*module);
		*module = NULL;
	}
	return r;
}

kv_result kv_unload_kernel(kv_api *a, kv_context ctx, void *module) {
	KV_CURRENT();
	return ((kv_result(*)(void *))a->moduleUnload)(module);
}

kv_result kv_address_range(kv_api *a, kv_context ctx, kv_dptr p, kv_dptr *base, size_t *size) {
	KV_CURRENT();
	return ((kv_result(*)(kv_dptr *, size_t *, kv_dptr))a->memGetAddressRange)(base, size, p);
}

typedef kv_result (*launch_fn)(void *, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                               unsigned, cu_handle, void **, void **);

kv_result kv_launch_runs(kv_api *a, kv_context ctx, void *fn, const kv_copy *c, size_t n, size_t per,
                         kv_stream s, size_t *fail_idx) {
	*fail_idx = 0;
	KV_CURRENT();
	// The driver copies a launch's parameter when the launch is enqueued,
	// so one buffer serves every launch. It is the parameter's full size:
	// the driver reads that much whatever the launch's grid.
	kv_copy *buf = calloc(per, sizeof *buf);
	if (!buf) return 2; // CUDA_ERROR_OUT_OF_MEMORY
	kv_result r = 0;
	for (size_t start = 0; start < n; start += per) {
		size_t k = n - start < per ? n - start : per;
		memcpy(buf, c + start, k * sizeof *buf);
		void *params[] = {buf};
		r = ((launch_fn)a->launchKernel)(fn, (unsigned)k, 1, 1, 256, 1, 1, 0, (cu_handle)s, params, NULL);
		if (r != 0) {
			*fail_idx = start;
			break;
		}
	}
	free(buf);
	return r;
}
