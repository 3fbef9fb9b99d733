//go:build cgo

// The few CUDA driver types and signatures kvpool uses, declared here so that
// no CUDA toolkit or header is needed at build time. Each signature is the
// ABI of the CUDA version it is resolved at through cuGetProcAddress (see
// kv_bind in cuda_shim.c), so a later driver that changes a function's ABI
// still hands back the variant declared here.

#ifndef KVPOOL_CUDA_SHIM_H
#define KVPOOL_CUDA_SHIM_H

#include <stddef.h>
#include <stdint.h>

typedef int kv_result;              // CUresult
typedef int kv_device;              // CUdevice
typedef void *kv_context;           // CUcontext
// Streams and events cross to Go as integers: Go must not hold a handle
// such as CU_STREAM_PER_THREAD (0x2) in a pointer-typed variable.
typedef uintptr_t kv_stream;        // CUstream
typedef uintptr_t kv_event;         // CUevent
typedef unsigned long long kv_dptr; // CUdeviceptr

// One copy of a batch; the same layout as cudart.Copy.
typedef struct {
	uint64_t dst, src, bytes;
} kv_copy;

// The function table of one loaded driver.
typedef struct {
	void *lib;
	int driver_version;

	void *getProcAddress; // cuGetProcAddress_v2
	void *init;
	void *driverGetVersion;
	void *getErrorName;
	void *getErrorString;
	void *deviceGetCount;
	void *deviceGet;
	void *deviceGetName;
	void *deviceGetUuid;
	void *primaryCtxRetain;
	void *primaryCtxRelease;
	void *ctxGetCurrent;
	void *ctxSetCurrent;
	void *memAlloc;
	void *memFree;
	void *memcpyHtoD;
	void *memcpyDtoH;
	void *memHostRegister;
	void *memHostUnregister;
	void *streamCreate;
	void *streamDestroy;
	void *streamSynchronize;
	void *eventCreate;
	void *eventDestroy;
	void *eventRecord;
	void *eventSynchronize;
	void *eventQuery;
	void *streamWaitEvent;
	void *memcpyHtoDAsync;
	void *memcpyDtoHAsync;
	void *launchHostFunc;
	// cuMemcpyBatchAsync, or NULL. batch_abi says which signature it has:
	// 12080 (with failIdx) or 13000 (without).
	void *memcpyBatchAsync;
	int batch_abi;
	// The copy kernel's entry points (kv_bind_kernel), or NULL.
	void *moduleLoadData;
	void *moduleUnload;
	void *moduleGetFunction;
	void *launchKernel;
	void *memGetAddressRange;
	void *streamCreateWithPriority;
	void *ctxGetStreamPriorityRange;
} kv_api;

// Loading. On failure kv_open returns NULL and *err holds a message in a
// malloc'd string the caller frees.
kv_api *kv_open(const char *path, char **err);
// kv_close unloads a library that failed before cuInit was called.
void kv_close(kv_api *a);
kv_result kv_driver_version(kv_api *a, int *v);
kv_result kv_bind(kv_api *a, const char **failed, int *status);

const char *kv_error_name(kv_api *a, kv_result r);
const char *kv_error_string(kv_api *a, kv_result r);

kv_result kv_init(kv_api *a);
kv_result kv_device_count(kv_api *a, int *n);
kv_result kv_device_get(kv_api *a, int ordinal, kv_device *d);
kv_result kv_device_name(kv_api *a, kv_device d, char *buf, int n);
// kv_device_uuid writes the device's 16-byte UUID (CUuuid) to out.
kv_result kv_device_uuid(kv_api *a, kv_device d, unsigned char *out);
kv_result kv_ctx_retain(kv_api *a, kv_device d, kv_context *ctx);
kv_result kv_ctx_release(kv_api *a, kv_device d);

// Every call below first makes ctx current on the calling OS thread. A cgo
// call runs start to end on one thread, so the pair cannot be split by the
// Go scheduler moving the goroutine.
kv_result kv_mem_alloc(kv_api *a, kv_context ctx, kv_dptr *p, size_t n);
kv_result kv_mem_free(kv_api *a, kv_context ctx, kv_dptr p);
kv_result kv_memcpy_htod(kv_api *a, kv_context ctx, kv_dptr dst, const void *src, size_t n);
kv_result kv_memcpy_dtoh(kv_api *a, kv_context ctx, void *dst, kv_dptr src, size_t n);
kv_result kv_host_register(kv_api *a, kv_context ctx, uint64_t p, size_t n, unsigned flags);
kv_result kv_host_unregister(kv_api *a, kv_context ctx, uint64_t p);
// kv_stream_create makes a stream with flags; a priority other than 0
// (lower numbers run first) needs kv_bind_kernel's entry points.
kv_result kv_stream_create(kv_api *a, kv_context ctx, kv_stream *s, unsigned flags, int priority);
// kv_greatest_priority is the context's greatest stream priority
// (cuCtxGetStreamPriorityRange).
kv_result kv_greatest_priority(kv_api *a, kv_context ctx, int *p);
kv_result kv_stream_destroy(kv_api *a, kv_context ctx, kv_stream s);
kv_result kv_stream_synchronize(kv_api *a, kv_context ctx, kv_stream s);
kv_result kv_event_create(kv_api *a, kv_context ctx, kv_event *e, unsigned flags);
kv_result kv_event_destroy(kv_api *a, kv_context ctx, kv_event e);
kv_result kv_event_record(kv_api *a, kv_context ctx, kv_event e, kv_stream s);
kv_result kv_event_synchronize(kv_api *a, kv_context ctx, kv_event e);
kv_result kv_event_query(kv_api *a, kv_context ctx, kv_event e);
kv_result kv_stream_wait_event(kv_api *a, kv_context ctx, kv_stream s, kv_event e);
kv_result kv_launch_host_func(kv_api *a, kv_context ctx, kv_stream s, uintptr_t handle);

// kv_bind_kernel resolves the entry points of the copy kernel (module
// loading, cuLaunchKernel, cuMemGetAddressRange, streams of a priority). They are optional: on
// failure *failed names the missing one and the kernel is not used.
kv_result kv_bind_kernel(kv_api *a, const char **failed);

// kv_load_kernel loads the PTX image (a NUL-terminated string) as a module
// and looks up its function name.
kv_result kv_load_kernel(kv_api *a, kv_context ctx, const char *ptx, const char *name,
                         void **module, void **fn);
kv_result kv_unload_kernel(kv_api *a, kv_context ctx, void *module);

// kv_address_range finds the device allocation that holds p
// (cuMemGetAddressRange).
kv_result kv_address_range(kv_api *a, kv_context ctx, kv_dptr p, kv_dptr *base, size_t *size);

// kv_launch_runs enqueues fn on s for n runs, at most per runs a launch:
// each launch gets its runs by value in a parameter of per*sizeof(kv_copy)
// bytes, one block of 256 threads a run. On failure *fail_idx is the first
// run of the launch that failed.
kv_result kv_launch_runs(kv_api *a, kv_context ctx, void *fn, const kv_copy *c, size_t n, size_t per,
                         kv_stream s, size_t *fail_idx);

// kv_memcpy enqueues n copies on s. dtoh selects the direction. With
// use_batch and a batch entry point it makes one cuMemcpyBatchAsync call
// (source access order STREAM); otherwise one cuMemcpy{HtoD,DtoH}Async per
// copy. *call names the call that failed and *fail_idx the copy.
kv_result kv_memcpy(kv_api *a, kv_context ctx, const kv_copy *c, size_t n, int dtoh,
                    kv_stream s, int use_batch, const char **call, size_t *fail_idx);

#endif
