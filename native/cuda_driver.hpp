// The CUDA driver entries the direct copy path calls, as a table of function pointers resolved at engine
// start with no CUDA headers and no libcuda at build time: dlopen("libcuda.so.1") (torch has it loaded
// when CUDA is in use) and cuGetProcAddress. The few types are declared by hand from the driver API's
// documentation (cuda.h): handles are opaque pointers, CUdeviceptr is a 64-bit address, and
// CUmemcpyAttributes is 24 bytes. fake_driver.hpp fills the same table with host memcpy stand-ins.
#pragma once
#include <dlfcn.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <type_traits>

namespace tkv::cu {

using CUresult = int;
using CUdevice = int;
using CUdeviceptr = unsigned long long;
using CUstream = struct CUstream_st*;
using CUevent = struct CUevent_st*;
using CUcontext = struct CUctx_st*;
using CUfunction = struct CUfunc_st*;

constexpr CUresult SUCCESS = 0;
constexpr CUresult ERROR_NOT_READY = 600;
constexpr unsigned EVENT_BLOCKING_SYNC = 0x1, EVENT_DISABLE_TIMING = 0x2;
constexpr unsigned STREAM_NON_BLOCKING = 0x1;
constexpr int SRC_ACCESS_ORDER_STREAM = 0x1;
constexpr unsigned MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 0x1;

struct MemLocation {  // CUmemLocation: { CUmemLocationType type; int id; }
    int type;
    int id;
};
struct MemcpyAttributes {  // CUmemcpyAttributes (v1)
    int srcAccessOrder;    // CUmemcpySrcAccessOrder
    MemLocation srcLocHint;
    MemLocation dstLocHint;
    unsigned flags;        // CUmemcpyFlags
};
static_assert(sizeof(MemLocation) == 8, "CUmemLocation is 8 bytes");
static_assert(sizeof(MemcpyAttributes) == 24 && offsetof(MemcpyAttributes, flags) == 20, "CUmemcpyAttributes is 24 bytes");

// cuMemcpyBatchAsync: the 12.8 ABI (PFN_cuMemcpyBatchAsync_v12080) reports the failing copy's index;
// 13.0's (cuMemcpyBatchAsync_v2, PFN_..._v13000) dropped that argument.
using BatchV12080 = CUresult (*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t,
                                 size_t*, CUstream);
using BatchV13000 = CUresult (*)(CUdeviceptr*, CUdeviceptr*, size_t*, size_t, MemcpyAttributes*, size_t*, size_t,
                                 CUstream);

struct Driver {
    int version = 0;          // cuDriverGetVersion (e.g. 12080, 13000); the fake reports its own
    BatchV12080 batch12 = nullptr;  // exactly one of batch12 / batch13 is set where the driver has a batch call
    BatchV13000 batch13 = nullptr;
    CUresult (*memcpy_async)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
    CUresult (*event_create)(CUevent*, unsigned) = nullptr;
    CUresult (*event_destroy)(CUevent) = nullptr;
    CUresult (*event_record)(CUevent, CUstream) = nullptr;
    CUresult (*event_query)(CUevent) = nullptr;
    CUresult (*event_synchronize)(CUevent) = nullptr;
    CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
    CUresult (*stream_destroy)(CUstream) = nullptr;
    CUresult (*stream_wait_event)(CUstream, CUevent, unsigned) = nullptr;
    CUresult (*stream_synchronize)(CUstream) = nullptr;
    CUresult (*ctx_get_current)(CUcontext*) = nullptr;
    CUresult (*ctx_set_current)(CUcontext) = nullptr;
    CUresult (*device_get)(CUdevice*, int) = nullptr;
    CUresult (*primary_ctx_retain)(CUcontext*, CUdevice) = nullptr;
    CUresult (*primary_ctx_release)(CUdevice) = nullptr;
    CUresult (*launch_kernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                              void**, void**) = nullptr;  // grid xyz, block xyz, shared bytes, stream, params, extra
    bool has_batch() const { return batch12 || batch13; }
};

// Fill `d` from libcuda; "" on success, else what is missing (the caller raises it as TransferError).
inline std::string load_driver(Driver& d) {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (!lib) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (!lib) return std::string("cannot load libcuda.so.1: ") + (dlerror() ? dlerror() : "not found");
    using Init = CUresult (*)(unsigned);
    using Version = CUresult (*)(int*);
    using GetProc2 = CUresult (*)(const char*, void**, int, uint64_t, int*);  // cuGetProcAddress_v2 (12.0+)
    using GetProc1 = CUresult (*)(const char*, void**, int, uint64_t);
    auto init = reinterpret_cast<Init>(dlsym(lib, "cuInit"));
    auto version = reinterpret_cast<Version>(dlsym(lib, "cuDriverGetVersion"));
    auto get2 = reinterpret_cast<GetProc2>(dlsym(lib, "cuGetProcAddress_v2"));
    auto get1 = reinterpret_cast<GetProc1>(dlsym(lib, "cuGetProcAddress"));
    if (!init || !version || (!get2 && !get1)) return "libcuda.so.1 lacks cuInit, cuDriverGetVersion or cuGetProcAddress";
    CUresult rc = init(0);
    if (rc != SUCCESS) return "cuInit failed with CUresult " + std::to_string(rc);
    if ((rc = version(&d.version)) != SUCCESS) return "cuDriverGetVersion failed with CUresult " + std::to_string(rc);
    auto get = [&](const char* name, int ver) -> void* {
        void* p = nullptr;
        int status = 0;
        CUresult r = get2 ? get2(name, &p, ver, 0, &status) : get1(name, &p, ver, 0);
        return r == SUCCESS && status == 0 ? p : nullptr;
    };
    std::string missing;
    auto need = [&](auto& slot, const char* name, int ver) {
        slot = reinterpret_cast<std::remove_reference_t<decltype(slot)>>(get(name, ver));
        if (!slot) missing += std::string(missing.empty() ? "" : ", ") + name;
    };
    need(d.memcpy_async, "cuMemcpyAsync", 3020);
    need(d.event_create, "cuEventCreate", 2000);
    need(d.event_destroy, "cuEventDestroy", 4000);
    need(d.event_record, "cuEventRecord", 2000);
    need(d.event_query, "cuEventQuery", 2000);
    need(d.event_synchronize, "cuEventSynchronize", 2000);
    need(d.stream_create, "cuStreamCreate", 2000);
    need(d.stream_destroy, "cuStreamDestroy", 4000);
    need(d.stream_wait_event, "cuStreamWaitEvent", 3020);
    need(d.stream_synchronize, "cuStreamSynchronize", 2000);
    need(d.ctx_get_current, "cuCtxGetCurrent", 4000);
    need(d.ctx_set_current, "cuCtxSetCurrent", 4000);
    need(d.device_get, "cuDeviceGet", 2000);
    need(d.primary_ctx_retain, "cuDevicePrimaryCtxRetain", 7000);
    need(d.primary_ctx_release, "cuDevicePrimaryCtxRelease", 11000);
    need(d.launch_kernel, "cuLaunchKernel", 4000);
    if (!missing.empty()) return "the CUDA driver (version " + std::to_string(d.version) + ") lacks " + missing;
    if (d.version >= 13000) d.batch13 = reinterpret_cast<BatchV13000>(get("cuMemcpyBatchAsync", 13000));
    else if (d.version >= 12080) d.batch12 = reinterpret_cast<BatchV12080>(get("cuMemcpyBatchAsync", 12080));
    return "";  // no batch call (driver < 12.8): cuMemcpyAsync per descriptor
}

}  // namespace tkv::cu
