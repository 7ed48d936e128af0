// The direct road's submit and completion (issue 46, items 3 and 5). One submit per call, run without the
// GIL: check the ids, plan the descriptors (copy_plan.hpp), make the copy stream wait for the caller's
// ready event, issue ONE cuMemcpyBatchAsync for every descriptor (cuMemcpyAsync per descriptor on
// drivers < 12.8), and record a done event taken from a pool. Streams and events are created once.
// Completion: one thread per direction waits on the done events in FIFO order (cuEventSynchronize, no
// GIL), bumps that direction's completed sequence number and writes an eventfd the event loop watches.
#pragma once
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "copy_plan.hpp"
#include "cuda_driver.hpp"

namespace tkv {

class DirectCopier {
public:
    enum Ready { NONE = 0, EVENT = 1, STREAM = 2 };  // what the copy waits on: nothing, an event, a stream's work

    DirectCopier(const cu::Driver& drv, int device, std::vector<PlanRegion> regions, i64 num_blocks, i64 num_slots,
                 i64 dma_rows)
        : d_(drv), regions_(std::move(regions)), num_blocks_(num_blocks), num_slots_(num_slots), dma_rows_(dma_rows) {
        check(d_.device_get(&dev_, device), "cuDeviceGet(" + S(device) + ")");
        check(d_.primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
        retained_ = true;
        fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (fd_ < 0) { close(); fail(Err::Transfer, "direct copy: eventfd failed (errno " + S(errno) + ")"); }
        Scope scope(*this);
        try {
            for (Dir& dir : dirs_) {
                check(d_.stream_create(&dir.stream, cu::STREAM_NON_BLOCKING), "cuStreamCreate");
                check(d_.event_create(&dir.ready, cu::EVENT_DISABLE_TIMING), "cuEventCreate");
            }
        } catch (...) { close(); throw; }
        for (int i = 0; i < 2; ++i) dirs_[i].thread = std::thread([this, i] { complete(dirs_[i]); });
    }
    DirectCopier(const DirectCopier&) = delete;
    DirectCopier& operator=(const DirectCopier&) = delete;
    ~DirectCopier() { close(); }

    // One call; direction 0 = store (GPU -> slab: src are GPU ids), 1 = load. Returns the call's sequence
    // number and the error of an enqueue that failed part-way (reported when its done event completes).
    // Throws TransferError when nothing was queued.
    std::pair<u64, std::string> submit(int direction, const std::vector<i64>& src, const std::vector<i64>& dst,
                                       int ready, u64 handle, const std::string& src_name, const std::string& dst_name) {
        if (closed_) fail(Err::Transfer, "direct copy: submit after close");
        const bool store = direction == 0;
        check_ids(src, dst, store ? num_blocks_ : num_slots_, store ? num_slots_ : num_blocks_, src_name, dst_name);
        Dir& dir = dirs_[direction];
        const i64 n = static_cast<i64>(src.size());
        plan_descriptors(regions_, (store ? src : dst).data(), (store ? dst : src).data(), n, store, dma_rows_, dir.desc, dir.order);
        Scope scope(*this);
        cu::CUevent done = take_event(dir);
        std::string error;
        try {
            if (ready == EVENT) {
                check(d_.stream_wait_event(dir.stream, reinterpret_cast<cu::CUevent>(handle), 0), "cuStreamWaitEvent");
            } else if (ready == STREAM) {
                check(d_.event_record(dir.ready, reinterpret_cast<cu::CUstream>(handle)), "cuEventRecord(ready)");
                check(d_.stream_wait_event(dir.stream, dir.ready, 0), "cuStreamWaitEvent");
            }
        } catch (...) { give_event(dir, done); throw; }
        error = issue(dir);
        cu::CUresult rc = d_.event_record(done, dir.stream);
        if (rc != cu::SUCCESS) {  // no event marks the end: wait here (without the GIL) for what was queued
            error += (error.empty() ? "" : "; ") + std::string("cuEventRecord(done) failed with CUresult ") + S(rc);
            d_.stream_synchronize(dir.stream);
            give_event(dir, done);
            done = nullptr;
        }
        std::lock_guard<std::mutex> lock(dir.mu);
        const u64 seq = ++dir.submitted;
        dir.queue.push_back(Pending{seq, done, error});
        dir.cv.notify_one();
        ++submits_;
        return {seq, error};
    }

    // Drain the eventfd; the completed sequence numbers per direction and the errors of calls completed since.
    std::pair<std::array<u64, 2>, std::vector<std::tuple<int, u64, std::string>>> poll() {
        u64 value;
        while (fd_ >= 0 && read(fd_, &value, sizeof value) == sizeof value) {}
        std::array<u64, 2> done{dirs_[0].completed.load(), dirs_[1].completed.load()};
        std::vector<std::tuple<int, u64, std::string>> errors;
        for (int i = 0; i < 2; ++i) {
            std::lock_guard<std::mutex> lock(dirs_[i].mu);
            for (auto it = dirs_[i].errors.begin(); it != dirs_[i].errors.end() && it->first <= done[i];)
                errors.emplace_back(i, it->first, it->second), it = dirs_[i].errors.erase(it);
        }
        return {done, errors};
    }

    // Stop the completion threads once their queues are empty, then free every stream and event. Idempotent.
    void close() {
        if (closed_) return;
        closed_ = true;
        for (Dir& dir : dirs_) {
            { std::lock_guard<std::mutex> lock(dir.mu); dir.stop = true; }
            dir.cv.notify_all();
            if (dir.thread.joinable()) dir.thread.join();
        }
        if (retained_) {
            Scope scope(*this);
            for (Dir& dir : dirs_) {
                for (cu::CUevent e : dir.pool) d_.event_destroy(e);
                dir.pool.clear();
                if (dir.ready) d_.event_destroy(dir.ready);
                if (dir.stream) d_.stream_destroy(dir.stream);
                dir.ready = nullptr;
                dir.stream = nullptr;
            }
        }
        if (retained_) d_.primary_ctx_release(dev_);
        retained_ = false;
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    int fd() const { return fd_; }
    bool closed() const { return closed_; }
    u64 stream(int direction) const { return reinterpret_cast<u64>(dirs_[direction].stream); }
    size_t last_descriptors(int direction) const { return dirs_[direction].desc.size(); }
    u64 submits() const { return submits_; }
    const cu::Driver& driver() const { return d_; }

private:
    struct Pending {
        u64 seq;
        cu::CUevent event;  // null: already complete (its record failed and the stream was synchronised)
        std::string error;
    };
    struct Dir {
        cu::CUstream stream = nullptr;
        cu::CUevent ready = nullptr;  // recorded on the caller's stream when it passes one (re-recorded per call)
        std::vector<cu::CUevent> pool;  // free done events
        std::deque<Pending> queue;
        std::map<u64, std::string> errors;
        std::mutex mu;
        std::condition_variable cv;
        std::thread thread;
        std::atomic<u64> completed{0};
        u64 submitted = 0;
        bool stop = false;
        Descriptors desc;  // reused per call (the submitting thread's only)
        std::vector<i64> order;
    };

    // The engine's context current for the scope (restored after: the caller's thread may use another GPU).
    struct Scope {
        const cu::Driver& d;
        cu::CUcontext saved = nullptr;
        bool swapped = false;
        explicit Scope(DirectCopier& c) : d(c.d_) {
            if (d.ctx_get_current(&saved) == cu::SUCCESS && saved != c.ctx_) swapped = d.ctx_set_current(c.ctx_) == cu::SUCCESS;
        }
        ~Scope() { if (swapped) d.ctx_set_current(saved); }
    };

    void check(cu::CUresult rc, const std::string& what) const {
        if (rc != cu::SUCCESS) fail(Err::Transfer, "direct copy: " + what + " failed with CUresult " + S(rc));
    }

    std::string issue(Dir& dir) {
        Descriptors& desc = dir.desc;
        const size_t count = desc.size();
        if (count == 0) return "";
        if (d_.has_batch()) {
            cu::MemcpyAttributes attr{};
            attr.srcAccessOrder = cu::SRC_ACCESS_ORDER_STREAM;
            attr.flags = cu::MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
            size_t first = 0, fail_idx = SIZE_MAX;
            auto* dst = reinterpret_cast<cu::CUdeviceptr*>(desc.dst.data());
            auto* src = reinterpret_cast<cu::CUdeviceptr*>(desc.src.data());
            cu::CUresult rc = d_.batch13 ? d_.batch13(dst, src, desc.bytes.data(), count, &attr, &first, 1, dir.stream)
                                         : d_.batch12(dst, src, desc.bytes.data(), count, &attr, &first, 1, &fail_idx, dir.stream);
            if (rc == cu::SUCCESS) return "";
            return "cuMemcpyBatchAsync of " + S(static_cast<i64>(count)) + " copies failed with CUresult " + S(rc) +
                   (fail_idx != SIZE_MAX ? " at copy " + S(static_cast<i64>(fail_idx)) : "");
        }
        for (size_t i = 0; i < count; ++i) {
            cu::CUresult rc = d_.memcpy_async(desc.dst[i], desc.src[i], desc.bytes[i], dir.stream);
            if (rc != cu::SUCCESS)
                return "cuMemcpyAsync " + S(static_cast<i64>(i)) + " of " + S(static_cast<i64>(count)) + " failed with CUresult " + S(rc);
        }
        return "";
    }

    cu::CUevent take_event(Dir& dir) {
        {
            std::lock_guard<std::mutex> lock(dir.mu);
            if (!dir.pool.empty()) {
                cu::CUevent e = dir.pool.back();
                dir.pool.pop_back();
                return e;
            }
        }
        cu::CUevent e = nullptr;  // blocking sync: the completion thread sleeps instead of spinning a core
        check(d_.event_create(&e, cu::EVENT_BLOCKING_SYNC | cu::EVENT_DISABLE_TIMING), "cuEventCreate(done)");
        return e;
    }

    void give_event(Dir& dir, cu::CUevent e) {
        std::lock_guard<std::mutex> lock(dir.mu);
        dir.pool.push_back(e);
    }

    void complete(Dir& dir) {
        d_.ctx_set_current(ctx_);
        std::unique_lock<std::mutex> lock(dir.mu);
        for (;;) {
            dir.cv.wait(lock, [&] { return dir.stop || !dir.queue.empty(); });
            if (dir.queue.empty()) return;  // stop, and nothing left to wait for
            Pending p = dir.queue.front();
            lock.unlock();
            cu::CUresult rc = p.event ? d_.event_synchronize(p.event) : cu::SUCCESS;
            lock.lock();
            if (rc != cu::SUCCESS)
                p.error += (p.error.empty() ? "" : "; ") + std::string("cuEventSynchronize failed with CUresult ") + S(rc);
            if (!p.error.empty()) dir.errors[p.seq] = p.error;
            if (p.event) dir.pool.push_back(p.event);
            dir.queue.pop_front();
            dir.completed.store(p.seq);
            const u64 one = 1;
            if (write(fd_, &one, sizeof one) < 0) {}  // a full counter already wakes the reader
        }
    }

    cu::Driver d_;
    std::vector<PlanRegion> regions_;
    i64 num_blocks_, num_slots_, dma_rows_;
    cu::CUdevice dev_ = 0;
    cu::CUcontext ctx_ = nullptr;
    bool retained_ = false, closed_ = false;
    int fd_ = -1;
    u64 submits_ = 0;
    Dir dirs_[2];
};

}  // namespace tkv
