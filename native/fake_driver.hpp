// A fake CUDA driver for tests without a GPU: the same cu::Driver table, whose streams are FIFOs of
// operations run on the host (copies are memcpy between host addresses: CPU tensors stand in for device
// memory), whose events complete when their stream reaches the record, and which counts every call.
// Streams run eagerly unless a test holds one (hold / step), which is how a test decides when events
// complete. cuStreamWaitEvent waits for the event's latest record at the time of the call, as CUDA's does.
// One process-wide device (a mutex and a condition variable); exposed to Python for tests only.
#pragma once
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <set>

#include "cuda_driver.hpp"
#include "ring_plan.hpp"

namespace tkv::fake {

using namespace tkv::cu;

constexpr CUresult ERROR_INVALID_VALUE = 1, ERROR_INVALID_HANDLE = 400;

struct Event {
    unsigned long long recorded = 0, completed = 0;  // records enqueued / executed
};

struct Op {
    enum Kind { Copy, Record, Wait, Launch } kind;
    CUdeviceptr src = 0, dst = 0;
    size_t bytes = 0;  // Launch: the element size
    Event* event = nullptr;
    unsigned long long gen = 0;  // Record: the record's number; Wait: the record waited for; Launch: 1 = scatter
    RingArgs ring{};  // Launch: the kernel's arguments, copied at launch as CUDA does
};

// The staged kernel's two functions (gather, scatter) per element size, as fake CUfunction handles.
inline char ring_functions[2][4];
inline CUfunction ring_function(bool load, int elem) {
    const int slot = elem == 8 ? 3 : elem == 4 ? 2 : elem == 2 ? 1 : 0;
    return reinterpret_cast<CUfunction>(&ring_functions[load ? 1 : 0][slot]);
}

struct Stream {
    std::deque<Op> ops;
    bool held = false;
    long long budget = 0;  // records a held stream may still execute (step)
};

struct Device {
    std::mutex mu;
    std::condition_variable cv;
    std::set<Event*> events;
    std::set<Stream*> streams;
    std::map<std::string, long long> counts;
    int fail_batches = 0;  // the next N batch calls fail (CUDA_ERROR_INVALID_VALUE)
    bool move_bytes = true;  // false: copies are counted, not executed (host-overhead timing)

    // Run every runnable op of every stream (lock held). A wait blocks its stream until its record ran.
    void pump() {
        bool progress = true, any = false;
        while (progress) {
            progress = false;
            for (Stream* s : streams) {
                while (!s->ops.empty()) {
                    Op& op = s->ops.front();
                    if (op.kind == Op::Wait && op.event->completed < op.gen) break;
                    if (s->held && s->budget <= 0) break;
                    if (op.kind == Op::Copy && move_bytes) std::memcpy(reinterpret_cast<void*>(op.dst), reinterpret_cast<void*>(op.src), op.bytes);
                    if (op.kind == Op::Launch && move_bytes) ring_reference(op.ring, static_cast<i64>(op.bytes), op.gen == 1);
                    if (op.kind == Op::Record) {
                        op.event->completed = std::max(op.event->completed, op.gen);
                        if (s->held) --s->budget;
                    }
                    s->ops.pop_front();
                    progress = any = true;
                }
            }
        }
        if (any) cv.notify_all();
    }
    bool live(Event* e) const { return events.count(e) != 0; }
    bool live(Stream* s) const { return streams.count(s) != 0; }
};

inline Device& device() {
    static Device* d = new Device();  // never destroyed: a completion thread may outlive static teardown
    return *d;
}

#define TKV_FAKE_LOCK Device& d = device(); std::unique_lock<std::mutex> lock(d.mu)

inline CUresult enqueue(CUstream h, Op op) {
    TKV_FAKE_LOCK;
    auto* s = reinterpret_cast<Stream*>(h);
    if (!d.live(s) || (op.event && !d.live(op.event))) return ERROR_INVALID_HANDLE;
    if (op.kind == Op::Record) op.gen = ++op.event->recorded;
    if (op.kind == Op::Wait) op.gen = op.event->recorded;
    s->ops.push_back(op);
    d.pump();
    return SUCCESS;
}

inline CUresult memcpy_async(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream s) {
    { TKV_FAKE_LOCK; ++d.counts["memcpy"]; }
    return enqueue(s, Op{Op::Copy, src, dst, n});
}

inline CUresult batch(CUdeviceptr* dsts, CUdeviceptr* srcs, size_t* sizes, size_t count, MemcpyAttributes* attrs,
                      size_t* idxs, size_t nattrs, CUstream s) {
    {
        TKV_FAKE_LOCK;
        ++d.counts["batch"];
        d.counts["descriptors"] += static_cast<long long>(count);
        if (d.fail_batches > 0) { --d.fail_batches; return ERROR_INVALID_VALUE; }
        // What the real call demands: every copy ordered with the stream, one attribute set from index 0.
        if (!count || !attrs || !idxs || nattrs != 1 || idxs[0] != 0 || attrs[0].srcAccessOrder != SRC_ACCESS_ORDER_STREAM)
            return ERROR_INVALID_VALUE;
    }
    for (size_t i = 0; i < count; ++i) {
        CUresult rc = enqueue(s, Op{Op::Copy, srcs[i], dsts[i], sizes[i]});
        if (rc != SUCCESS) return rc;
    }
    return SUCCESS;
}

inline CUresult batch12(CUdeviceptr* d, CUdeviceptr* s, size_t* n, size_t c, MemcpyAttributes* a, size_t* i, size_t k,
                        size_t* fail_idx, CUstream st) {
    CUresult rc = batch(d, s, n, c, a, i, k, st);
    if (fail_idx) *fail_idx = rc == SUCCESS ? SIZE_MAX : 0;
    return rc;
}

inline CUresult launch_kernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned, unsigned,
                              unsigned, CUstream s, void** params, void** extra) {
    Op op{Op::Launch};
    for (int load = 0; load < 2; ++load)
        for (int e = 0; e < 4; ++e)
            if (f == ring_function(load != 0, 1 << e)) op.gen = static_cast<unsigned long long>(load), op.bytes = size_t(1) << e, op.src = 1;
    if (!op.src || !params || extra || gx < 1 || gy != 1 || gz != 1 || bx < 1) return ERROR_INVALID_VALUE;
    op.src = 0;
    const void* p[9];
    for (int i = 0; i < 9; ++i) p[i] = params[i];
    auto u = [&](int i) { return *static_cast<const u64*>(p[i]); };
    op.ring = RingArgs{u(0), u(1), u(2), u(3), u(4), *static_cast<const i64*>(p[5]), *static_cast<const i64*>(p[6]),
                       *static_cast<const int*>(p[7]), *static_cast<const int*>(p[8])};
    { TKV_FAKE_LOCK; ++d.counts["launch"]; d.counts["programs"] += gx; }
    return enqueue(s, op);
}

inline CUresult event_create(CUevent* out, unsigned) {
    TKV_FAKE_LOCK;
    auto* e = new Event();
    d.events.insert(e);
    ++d.counts["event_create"];
    *out = reinterpret_cast<CUevent>(e);
    return SUCCESS;
}

inline CUresult event_destroy(CUevent h) {
    TKV_FAKE_LOCK;
    auto* e = reinterpret_cast<Event*>(h);
    if (!d.live(e)) return ERROR_INVALID_HANDLE;
    for (Stream* s : d.streams)  // CUDA lets a destroyed event's pending work finish; here it must not dangle
        for (Op& op : s->ops)
            if (op.event == e) return ERROR_INVALID_VALUE;
    d.events.erase(e);
    delete e;
    ++d.counts["event_destroy"];
    return SUCCESS;
}

inline CUresult event_record(CUevent e, CUstream s) {
    { TKV_FAKE_LOCK; ++d.counts["record"]; }
    return enqueue(s, Op{Op::Record, 0, 0, 0, reinterpret_cast<Event*>(e)});
}

inline CUresult stream_wait_event(CUstream s, CUevent e, unsigned) {
    { TKV_FAKE_LOCK; ++d.counts["wait"]; }
    return enqueue(s, Op{Op::Wait, 0, 0, 0, reinterpret_cast<Event*>(e)});
}

inline CUresult event_query(CUevent h) {
    TKV_FAKE_LOCK;
    auto* e = reinterpret_cast<Event*>(h);
    if (!d.live(e)) return ERROR_INVALID_HANDLE;
    ++d.counts["query"];
    return e->completed >= e->recorded ? SUCCESS : ERROR_NOT_READY;
}

inline CUresult event_synchronize(CUevent h) {
    TKV_FAKE_LOCK;
    auto* e = reinterpret_cast<Event*>(h);
    if (!d.live(e)) return ERROR_INVALID_HANDLE;
    ++d.counts["synchronize"];
    const unsigned long long target = e->recorded;
    d.cv.wait(lock, [&] { return e->completed >= target; });
    return SUCCESS;
}

inline CUresult stream_create(CUstream* out, unsigned) {
    TKV_FAKE_LOCK;
    auto* s = new Stream();
    d.streams.insert(s);
    ++d.counts["stream_create"];
    *out = reinterpret_cast<CUstream>(s);
    return SUCCESS;
}

inline CUresult stream_destroy(CUstream h) {
    TKV_FAKE_LOCK;
    auto* s = reinterpret_cast<Stream*>(h);
    if (!d.live(s)) return ERROR_INVALID_HANDLE;
    if (!s->ops.empty()) return ERROR_INVALID_VALUE;  // a test left work queued behind a hold
    d.streams.erase(s);
    delete s;
    ++d.counts["stream_destroy"];
    return SUCCESS;
}

inline CUresult stream_synchronize(CUstream h) {
    TKV_FAKE_LOCK;
    auto* s = reinterpret_cast<Stream*>(h);
    if (!d.live(s)) return ERROR_INVALID_HANDLE;
    d.cv.wait(lock, [&] { return s->ops.empty(); });
    return SUCCESS;
}

inline thread_local CUcontext current_ctx = nullptr;
inline CUresult ctx_get(CUcontext* c) { *c = current_ctx; return SUCCESS; }
inline CUresult ctx_set(CUcontext c) { { TKV_FAKE_LOCK; ++d.counts["ctx_set"]; } current_ctx = c; return SUCCESS; }
inline CUresult device_get(CUdevice* dev, int ordinal) { *dev = ordinal; return SUCCESS; }
inline CUresult ctx_retain(CUcontext* c, CUdevice dev) { *c = reinterpret_cast<CUcontext>(std::uintptr_t(0x1000 + dev)); return SUCCESS; }
inline CUresult ctx_release(CUdevice) { return SUCCESS; }

// The fake table; `version` picks the batch ABI as the real loader does (< 12080: no batch call).
inline Driver driver(int version) {
    Driver t;
    t.version = version;
    if (version >= 13000) t.batch13 = batch;
    else if (version >= 12080) t.batch12 = batch12;
    t.memcpy_async = memcpy_async;
    t.event_create = event_create;
    t.event_destroy = event_destroy;
    t.event_record = event_record;
    t.event_query = event_query;
    t.event_synchronize = event_synchronize;
    t.stream_create = stream_create;
    t.stream_destroy = stream_destroy;
    t.stream_wait_event = stream_wait_event;
    t.stream_synchronize = stream_synchronize;
    t.ctx_get_current = ctx_get;
    t.ctx_set_current = ctx_set;
    t.device_get = device_get;
    t.primary_ctx_retain = ctx_retain;
    t.primary_ctx_release = ctx_release;
    t.launch_kernel = launch_kernel;
    return t;
}

// Test controls: hold a stream (its ops wait), let a held stream run `records` more event records.
inline void hold(CUstream h, bool held) {
    TKV_FAKE_LOCK;
    auto* s = reinterpret_cast<Stream*>(h);
    if (!d.live(s)) return;
    s->held = held;
    s->budget = 0;
    d.pump();
}

inline void step(CUstream h, long long records) {
    TKV_FAKE_LOCK;
    auto* s = reinterpret_cast<Stream*>(h);
    if (!d.live(s)) return;
    s->budget += records;
    d.pump();
}

#undef TKV_FAKE_LOCK

}  // namespace tkv::fake
