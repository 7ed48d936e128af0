// The direct road's submit and completion (issue 46, items 5 and 9). One submit per call, run without the
// GIL: check the ids, plan the descriptors (copy_plan.hpp), make the copy stream wait for the caller's
// ready event, issue ONE cuMemcpyBatchAsync for every descriptor (cuMemcpyAsync per descriptor on
// drivers < 12.8), and record a done event taken from a pool. Streams and events are created once.
// Calls in flight: at most max_inflight issued calls per direction; a later call is parked (its readiness
// snapshotted into an event of ours at submit, so it is ordered after what the caller had queued then, not
// later) and issued by the completion thread, in order, as soon as a slot frees. Nothing blocks the caller.
// Completion: one thread per direction waits on the done events in FIFO order (cuEventSynchronize, no
// GIL), bumps that direction's completed sequence number and writes an eventfd the event loop watches.
// Layered loads (item 9): the last block of each job whole first (mark 0), then the other blocks one region
// group at a time (mark 1 + g); wait_mark makes a stream wait for one mark only.
#pragma once
#include <sys/eventfd.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <tuple>

#include "staged_issue.hpp"

namespace tkv {

// A layered load's shape: edge[i] != 0 marks position i as copied whole first; groups are region indices.
struct Layers {
    std::vector<char> edge;
    std::vector<std::vector<int>> groups;
};

class DirectCopier {
public:
    enum Ready { NONE = 0, EVENT = 1, STREAM = 2 };  // what the copy waits on: nothing, an event, a stream's work

    DirectCopier(const cu::Driver& drv, int device, std::vector<PlanRegion> regions, i64 num_blocks, i64 num_slots,
                 i64 dma_rows, int max_inflight = 4)
        : d_(drv), regions_(std::move(regions)), num_blocks_(num_blocks), num_slots_(num_slots), dma_rows_(dma_rows),
          cap_(static_cast<size_t>(max_inflight < 1 ? 1 : max_inflight)) {
        check(d_.device_get(&dev_, device), "cuDeviceGet(" + S(device) + ")");
        check(d_.primary_ctx_retain(&ctx_, dev_), "cuDevicePrimaryCtxRetain");
        retained_ = true;
        fd_ = eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
        if (fd_ < 0) { close(); fail(Err::Transfer, "direct copy: eventfd failed (errno " + S(errno) + ")"); }
        Scope scope(*this);
        try {
            for (Dir& dir : dirs_) {
                dir.store = &dir == &dirs_[0];
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
    // Throws TransferError when nothing was queued. layers: a layered load (direction 1 only).
    std::pair<u64, std::string> submit(int direction, std::vector<i64> src, std::vector<i64> dst, int ready, u64 handle,
                                       const std::string& src_name, const std::string& dst_name,
                                       std::shared_ptr<const Layers> layers = nullptr) {
        if (closed_) fail(Err::Transfer, "direct copy: submit after close");
        const bool store = direction == 0;
        check_ids(src, dst, store ? num_blocks_ : num_slots_, store ? num_slots_ : num_blocks_, src_name, dst_name);
        if (layers && layers->edge.size() != src.size())
            fail(Err::Transfer, "direct copy: " + S(static_cast<i64>(layers->edge.size())) + " edge flags for " + S(static_cast<i64>(src.size())) + " blocks");
        Dir& dir = dirs_[direction];
        Scope scope(*this);
        std::lock_guard<std::mutex> lock(dir.mu);
        Call call{dir.submitted + 1, std::move(src), std::move(dst), ready, handle, nullptr, std::move(layers)};
        if (dir.queue.size() < cap_ && dir.parked.empty()) {
            std::string error;
            if (!issue(dir, call, error)) fail(Err::Transfer, "direct copy: " + error);  // nothing queued
            ++dir.submitted;
            ++submits_;
            return {call.seq, error};
        }
        snapshot(dir, call);  // throws with nothing parked
        ++dir.submitted;
        ++submits_;
        dir.parked.push_back(std::move(call));
        return {dir.submitted, ""};
    }

    // Drain the eventfd; the completed sequence numbers per direction and the errors of calls completed since.
    std::pair<std::array<u64, 2>, std::vector<std::tuple<int, u64, std::string>>> poll() {
        u64 value;
        while (fd_ >= 0 && read(fd_, &value, sizeof value) == sizeof value) {}
        std::array<u64, 2> done{dirs_[0].completed.load(), dirs_[1].completed.load()};
        std::vector<std::tuple<int, u64, std::string>> errors;
        for (int i = 0; i < 2; ++i) {
            if (dirs_[i].failed.load() == 0) continue;  // the lock may be held while a parked call is issued
            std::lock_guard<std::mutex> lock(dirs_[i].mu);
            for (auto it = dirs_[i].errors.begin(); it != dirs_[i].errors.end() && it->first <= done[i];)
                errors.emplace_back(i, it->first, it->second), it = dirs_[i].errors.erase(it), --dirs_[i].failed;
        }
        return {done, errors};
    }

    // Block (call without the GIL) until call `seq` of `direction` completed; false after timeout_s (< 0: none).
    bool wait(int direction, u64 seq, double timeout_s) {
        Dir& dir = dirs_[direction];
        std::unique_lock<std::mutex> lock(dir.mu);
        return until(dir, lock, timeout_s, [&] { return dir.completed.load() >= seq || seq > dir.submitted; });
    }

    // Make `stream` wait for mark `mark` of layered load `seq` (0: its edge blocks, 1 + g: region group g).
    // A parked load is waited for (host) until issued; a completed one needs no wait. False after timeout_s.
    bool wait_mark(u64 seq, size_t mark, u64 stream, double timeout_s) {
        Dir& dir = dirs_[1];
        Scope scope(*this);
        std::unique_lock<std::mutex> lock(dir.mu);
        const Pending* p = nullptr;
        auto issued = [&] {
            if (dir.completed.load() >= seq || seq > dir.submitted) return true;
            for (const Pending& q : dir.queue) if (q.seq == seq) { p = &q; return true; }
            return false;
        };
        if (!until(dir, lock, timeout_s, issued)) return false;
        if (!p) return true;
        if (mark >= p->marks.size()) fail(Err::Transfer, "direct copy: call " + S(static_cast<i64>(seq)) + " has " + S(static_cast<i64>(p->marks.size())) + " marks, not " + S(static_cast<i64>(mark + 1)));
        if (p->marks[mark]) check(d_.stream_wait_event(reinterpret_cast<cu::CUstream>(stream), p->marks[mark], 0), "cuStreamWaitEvent(mark)");
        return true;
    }

    // Stop the completion threads once every call completed, then free every stream and event. Idempotent.
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
                for (auto* pool : {&dir.pool, &dir.snaps, &dir.marks})
                    for (cu::CUevent e : *pool) d_.event_destroy(e);
                dir.pool.clear(), dir.snaps.clear(), dir.marks.clear();
                if (dir.ready) d_.event_destroy(dir.ready);
                for (cu::CUstream s : {dir.stream, dir.aux}) if (s) d_.stream_destroy(s);
                dir.ready = nullptr;
                dir.stream = dir.aux = nullptr;
            }
            d_.primary_ctx_release(dev_);
        }
        retained_ = false;
        if (fd_ >= 0) ::close(fd_);
        fd_ = -1;
    }

    int fd() const { return fd_; }
    bool closed() const { return closed_; }
    u64 stream(int direction) const { return reinterpret_cast<u64>(dirs_[direction].stream); }
    size_t last_descriptors(int direction) const { return dirs_[direction].last_desc; }
    u64 submits() const { return submits_; }
    size_t max_inflight() const { return cap_; }
    size_t num_regions() const { return regions_.size(); }
    // Take the staged road (small rows through staging) for every later call but layered loads; before any call.
    void set_staged(std::unique_ptr<StagedRoad> road) {
        if (submits_ != 0) fail(Err::Transfer, "direct copy: set_staged after the first call");
        if (!road->function[0] || !road->function[1] || road->ring[0].empty() || road->ring[1].empty() || road->chunk_rows < 1 ||
            road->elem < 1 || road->row_bytes % road->elem != 0 || road->max_rows < std::max(num_blocks_, num_slots_))
            fail(Err::Transfer, "direct copy: a staged road needs both kernels, a ring per direction, chunk rows >= 1 and ids slots "
                                "of max(blocks, slots) = " + S(std::max(num_blocks_, num_slots_)) + " rows");
        staged_ = std::move(road);
    }
    bool staged() const { return staged_ != nullptr; }
    // (issued and not completed, parked) calls of one direction.
    std::pair<size_t, size_t> inflight(int direction) {
        std::lock_guard<std::mutex> lock(dirs_[direction].mu);
        return {dirs_[direction].queue.size(), dirs_[direction].parked.size()};
    }
    const cu::Driver& driver() const { return d_; }

private:
    struct Call {
        u64 seq;
        std::vector<i64> src, dst;
        int ready;
        u64 handle;
        cu::CUevent snapshot;  // parked: our event the readiness was recorded into (pool: snaps)
        std::shared_ptr<const Layers> layers;
    };
    struct Pending {
        u64 seq;
        cu::CUevent event;  // null: already complete (its record failed and the stream was synchronised)
        std::string error;
        cu::CUevent snapshot;
        std::vector<cu::CUevent> marks;  // a layered load's marks (null: its record failed, stream synchronised)
    };
    struct Dir {
        bool store = true;
        cu::CUstream stream = nullptr;
        cu::CUstream aux = nullptr;   // snapshots of a parked call's ready event (waits and records only)
        cu::CUevent ready = nullptr;  // recorded on the caller's stream when it passes one (re-recorded per call)
        std::vector<cu::CUevent> pool, snaps, marks;  // free done events, snapshot events, layer marks
        std::deque<Pending> queue;   // issued, in order
        std::deque<Call> parked;     // waiting for an in-flight slot, in order
        std::map<u64, std::string> errors;
        std::mutex mu;               // guards all of the above, and issuing (the descriptors below)
        std::condition_variable cv;
        std::thread thread;
        std::atomic<u64> completed{0};
        std::atomic<size_t> failed{0};  // entries in errors
        u64 submitted = 0;
        bool stop = false;
        Descriptors desc;
        RingPlan ring;  // the staged road's plan of the call being issued
        std::vector<i64> order, gpu, slots;
        size_t last_desc = 0;
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
    template <class Pred>
    static bool until(Dir& dir, std::unique_lock<std::mutex>& lock, double timeout_s, Pred pred) {
        if (timeout_s < 0) { dir.cv.wait(lock, pred); return true; }
        return dir.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), pred);
    }
    static void add(std::string& error, const std::string& more) { error += (error.empty() ? "" : "; ") + more; }
    static void add_error(std::string& error, const std::string& more) { if (!more.empty()) add(error, more); }

    cu::CUevent take(std::vector<cu::CUevent>& pool, unsigned flags, const char* what) {  // dir.mu held
        if (!pool.empty()) {
            cu::CUevent e = pool.back();
            pool.pop_back();
            return e;
        }
        cu::CUevent e = nullptr;
        check(d_.event_create(&e, flags), std::string("cuEventCreate(") + what + ")");
        return e;
    }

    // Record what a parked call must wait for now, into an event of ours (dir.mu held). Throws, nothing kept.
    void snapshot(Dir& dir, Call& call) {
        if (call.ready == NONE) return;
        cu::CUevent e = take(dir.snaps, cu::EVENT_DISABLE_TIMING, "snapshot");
        try {
            if (call.ready == STREAM) {
                check(d_.event_record(e, reinterpret_cast<cu::CUstream>(call.handle)), "cuEventRecord(ready)");
            } else {  // an event cannot be copied: a side stream waits for it and records ours
                if (!dir.aux) check(d_.stream_create(&dir.aux, cu::STREAM_NON_BLOCKING), "cuStreamCreate(aux)");
                check(d_.stream_wait_event(dir.aux, reinterpret_cast<cu::CUevent>(call.handle), 0), "cuStreamWaitEvent");
                check(d_.event_record(e, dir.aux), "cuEventRecord(snapshot)");
            }
        } catch (...) { dir.snaps.push_back(e); throw; }
        call.ready = EVENT;
        call.handle = reinterpret_cast<u64>(e);
        call.snapshot = e;
    }

    // Queue one call on the copy stream (dir.mu held). False (error set) when nothing was queued.
    bool issue(Dir& dir, Call& call, std::string& error) {
        // Every event this call records is taken first: a failed cuEventCreate queues nothing.
        Pending p{call.seq, nullptr, "", call.snapshot, {}};
        auto give_back = [&] {
            if (p.event) dir.pool.push_back(p.event);
            dir.marks.insert(dir.marks.end(), p.marks.begin(), p.marks.end());
        };
        try {
            p.event = take(dir.pool, cu::EVENT_BLOCKING_SYNC | cu::EVENT_DISABLE_TIMING, "done");
            for (size_t m = 0; call.layers && m <= call.layers->groups.size(); ++m)
                p.marks.push_back(take(dir.marks, cu::EVENT_DISABLE_TIMING, "mark"));
        } catch (...) { give_back(); throw; }
        cu::CUresult rc = cu::SUCCESS;
        if (call.ready == EVENT) {
            rc = d_.stream_wait_event(dir.stream, reinterpret_cast<cu::CUevent>(call.handle), 0);
            if (rc != cu::SUCCESS) error = "cuStreamWaitEvent failed with CUresult " + S(rc);
        } else if (call.ready == STREAM) {
            rc = d_.event_record(dir.ready, reinterpret_cast<cu::CUstream>(call.handle));
            if (rc != cu::SUCCESS) error = "cuEventRecord(ready) failed with CUresult " + S(rc);
            else if ((rc = d_.stream_wait_event(dir.stream, dir.ready, 0)) != cu::SUCCESS)
                error = "cuStreamWaitEvent failed with CUresult " + S(rc);
        }
        if (rc != cu::SUCCESS) { give_back(); return false; }
        cu::CUevent done = p.event;
        const i64 n = static_cast<i64>(call.src.size());
        const std::vector<i64>& g = dir.store ? call.src : call.dst;
        const std::vector<i64>& s = dir.store ? call.dst : call.src;
        if (!call.layers && staged_) {
            add_error(p.error, issue_staged(d_, *staged_, dir.store ? 0 : 1, call.seq, cap_, g.data(), s.data(), n, dma_rows_, dir.stream,
                                            dir.ring, dir.order, dir.desc));
            dir.last_desc = dir.ring.desc.size();
        } else if (!call.layers) {
            plan_descriptors(regions_, g.data(), s.data(), n, dir.store, dma_rows_, dir.desc, dir.order);
            add_error(p.error, submit_batch(d_, dir.desc, dir.stream));
            dir.last_desc = dir.desc.size();
        } else {
            dir.last_desc = 0;
            for (size_t part = 0; part <= call.layers->groups.size(); ++part) {
                dir.gpu.clear(), dir.slots.clear();
                for (i64 i = 0; i < n; ++i)
                    if ((call.layers->edge[static_cast<size_t>(i)] != 0) == (part == 0)) dir.gpu.push_back(g[i]), dir.slots.push_back(s[i]);
                const std::vector<int>* only = part == 0 ? nullptr : &call.layers->groups[part - 1];
                plan_descriptors(regions_, dir.gpu.data(), dir.slots.data(), static_cast<i64>(dir.gpu.size()), false, dma_rows_, dir.desc, dir.order, only);
                add_error(p.error, submit_batch(d_, dir.desc, dir.stream));
                dir.last_desc += dir.desc.size();
                cu::CUevent& mark = p.marks[part];
                if ((rc = d_.event_record(mark, dir.stream)) != cu::SUCCESS) {  // its waiters must not wait on a stale record
                    add(p.error, "cuEventRecord(mark " + S(static_cast<i64>(part)) + ") failed with CUresult " + S(rc));
                    d_.stream_synchronize(dir.stream);
                    dir.marks.push_back(mark);
                    mark = nullptr;
                }
            }
        }
        rc = d_.event_record(done, dir.stream);
        if (rc != cu::SUCCESS) {  // no event marks the end: wait here (without the GIL) for what was queued
            add(p.error, "cuEventRecord(done) failed with CUresult " + S(rc));
            d_.stream_synchronize(dir.stream);
            dir.pool.push_back(done);
            p.event = nullptr;
        }
        error = p.error;
        dir.queue.push_back(std::move(p));
        dir.cv.notify_all();
        return true;
    }

    void complete(Dir& dir) {
        d_.ctx_set_current(ctx_);
        std::unique_lock<std::mutex> lock(dir.mu);
        for (;;) {
            dir.cv.wait(lock, [&] { return dir.stop || !dir.queue.empty(); });
            if (dir.queue.empty()) return;  // stop, and nothing left (a parked call always has one issued before it)
            const cu::CUevent event = dir.queue.front().event;
            lock.unlock();
            cu::CUresult rc = event ? d_.event_synchronize(event) : cu::SUCCESS;
            lock.lock();
            Pending p = std::move(dir.queue.front());
            dir.queue.pop_front();
            if (rc != cu::SUCCESS) add(p.error, "cuEventSynchronize failed with CUresult " + S(rc));
            if (!p.error.empty()) dir.errors[p.seq] = p.error, ++dir.failed;
            if (p.event) dir.pool.push_back(p.event);
            if (p.snapshot) dir.snaps.push_back(p.snapshot);
            for (cu::CUevent m : p.marks) if (m) dir.marks.push_back(m);
            dir.completed.store(p.seq);
            while (!dir.parked.empty() && dir.queue.size() < cap_) {  // a slot is free: the oldest parked call
                Call call = std::move(dir.parked.front());
                dir.parked.pop_front();
                std::string error;
                try {
                    if (!issue(dir, call, error)) dir.queue.push_back(Pending{call.seq, nullptr, error, call.snapshot, {}});
                } catch (const std::exception& e) {  // an event could not be created: fail the call, not the thread
                    dir.queue.push_back(Pending{call.seq, nullptr, e.what(), call.snapshot, {}});
                }
            }
            const u64 one = 1;
            if (write(fd_, &one, sizeof one) < 0) {}  // a full counter already wakes the reader
            dir.cv.notify_all();
        }
    }

    cu::Driver d_;
    std::unique_ptr<StagedRoad> staged_;
    std::vector<PlanRegion> regions_;
    i64 num_blocks_, num_slots_, dma_rows_;
    size_t cap_;
    cu::CUdevice dev_ = 0;
    cu::CUcontext ctx_ = nullptr;
    bool retained_ = false, closed_ = false;
    int fd_ = -1;
    u64 submits_ = 0;
    Dir dirs_[2];
};

}  // namespace tkv
