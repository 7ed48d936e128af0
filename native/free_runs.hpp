// The free slots of one tier as maximal runs of consecutive slots (an extent map), so that a call's
// slots come out as few runs as the free slots allow: a copy engine issues one memcpy / DMA per run
// (copy-path-design.md 2.1.5).
//
// take(m): the longest runs first (the lowest start among equally long ones), each taken whole while
// it fits in what is still wanted; the rest comes from the low end of the shortest run that holds it
// (best fit, the lowest start among equals). That is as few runs as any choice of m free slots gives,
// and it leaves the long runs for later calls. The slots come back ascending.
// give(s): freed slots join their neighbouring runs. The state is a function of the set of free slots
// alone (runs are maximal), so giving back what a take handed out restores it exactly.
//
// Two ordered indexes over the runs, by start and by (length, start): O(log r) per run touched, r the
// number of free runs; memory per free run, none per slot (a full tier holds none).
#pragma once
#include <map>
#include <set>
#include <utility>

#include "common.hpp"

namespace tkv {

class FreeRuns {
public:
    explicit FreeRuns(i64 n) : n_(n) {
        if (n > 0) add(0, n);
    }

    i64 size() const { return n_; }
    i64 count() const { return count_; }
    i64 num_runs() const { return static_cast<i64>(by_start_.size()); }
    // Tree nodes: a red-black node's links and colour (32 B) plus the entry, each index.
    size_t nbytes() const { return by_start_.size() * (2 * 32 + sizeof(Node) + sizeof(Run)); }

    // The runs, ascending by start, as (start, length) pairs (tests and debugging).
    std::vector<std::pair<i64, i64>> runs() const {
        std::vector<std::pair<i64, i64>> out;
        out.reserve(by_start_.size());
        for (const auto& r : by_start_) out.emplace_back(r.first, r.second);
        return out;
    }

    // m slots (0 <= m <= count()) into out[0..m), ascending.
    void take(i64 m, i64* out) {
        if (m < 0 || m > count_) fail(Err::Tier, "free runs: take(" + S(m) + ") of " + S(count_) + " free slots");
        i64 got = 0;
        while (got < m) {
            i64 want = m - got;
            i64 longest = std::prev(by_len_.end())->first;
            auto it = longest <= want ? by_len_.lower_bound(Run{longest, -1}) : by_len_.lower_bound(Run{want, -1});
            i64 start = it->second, len = it->first, k = std::min(len, want);
            remove(start, len);
            if (k < len) add(start + k, len - k);
            for (i64 i = 0; i < k; ++i) out[got + i] = start + i;
            got += k;
        }
        std::sort(out, out + m);
    }

    // Slots s[0..m) become free: each in range, distinct and not free already, else nothing changes.
    void give(const i64* s, i64 m) {
        if (m <= 0) return;
        if (count_ + m > n_) fail(Err::Tier, "free runs: more slots freed than exist");
        std::vector<i64> sorted(s, s + m);
        std::sort(sorted.begin(), sorted.end());
        if (sorted[0] < 0 || sorted[m - 1] >= n_) fail(Err::Tier, "free runs: a freed slot is outside [0, " + S(n_) + ")");
        auto rep = std::adjacent_find(sorted.begin(), sorted.end());
        if (rep != sorted.end()) fail(Err::Tier, "free runs: slot " + S(*rep) + " is freed twice in one batch");
        for (i64 i = 0; i < m;) {  // checked whole before anything changes
            i64 j = run_end(sorted, i);
            i64 hit = overlap(sorted[i], sorted[j - 1] + 1);
            if (hit >= 0) fail(Err::Tier, "free runs: slot " + S(hit) + " is free already");
            i = j;
        }
        for (i64 i = 0; i < m;) {
            i64 j = run_end(sorted, i);
            join(sorted[i], j - i);
            i = j;
        }
    }

    // Free exactly the slots whose used[s] is 0.
    void reset(const u8* used) {
        by_start_.clear();
        by_len_.clear();
        count_ = 0;
        for (i64 s = 0; s < n_;) {
            if (used[s]) {
                ++s;
                continue;
            }
            i64 e = s + 1;
            while (e < n_ && !used[e]) ++e;
            add(s, e - s);
            s = e;
        }
    }

    // Raises unless the runs are in range, disjoint, maximal, indexed twice alike and counted right;
    // marks free slots in is_free (n bytes, zeroed by the caller), raising on a slot marked twice.
    void check(u8* is_free, const std::string& name) const {
        if (by_start_.size() != by_len_.size()) fail(Err::Tier, name + ": the free runs' two indexes disagree");
        i64 total = 0, end = -1;
        for (const auto& r : by_start_) {
            i64 s = r.first, len = r.second;
            if (len <= 0 || s < 0 || s + len > n_) fail(Err::Tier, name + ": a free run is empty or out of range");
            if (s <= end) fail(Err::Tier, name + ": free runs overlap or touch (not maximal)");
            if (!by_len_.count(Run{len, s})) fail(Err::Tier, name + ": a free run is missing from the length index");
            for (i64 x = s; x < s + len; ++x) {
                if (is_free[x]) fail(Err::Tier, name + ": a slot is on the free list twice");
                is_free[x] = 1;
            }
            total += len;
            end = s + len;
        }
        if (total != count_) fail(Err::Tier, name + ": the free count drifted from the free runs");
    }

private:
    using Node = std::pair<const i64, i64>;  // by_start_: start -> length
    using Run = std::pair<i64, i64>;         // by_len_: (length, start)

    void add(i64 start, i64 len) {
        by_start_.emplace(start, len);
        by_len_.emplace(len, start);
        count_ += len;
    }
    void remove(i64 start, i64 len) {
        by_start_.erase(start);
        by_len_.erase(Run{len, start});
        count_ -= len;
    }
    static i64 run_end(const std::vector<i64>& sorted, i64 i) {
        i64 j = i + 1;
        while (j < static_cast<i64>(sorted.size()) && sorted[j] == sorted[j - 1] + 1) ++j;
        return j;
    }
    // A free slot in [a, b), or -1.
    i64 overlap(i64 a, i64 b) const {
        auto next = by_start_.lower_bound(a);
        if (next != by_start_.end() && next->first < b) return next->first;
        if (next != by_start_.begin()) {
            auto prev = std::prev(next);
            if (prev->first + prev->second > a) return a;
        }
        return -1;
    }
    // The run [start, start + len) (no slot of it free) joins the runs that end at start and begin at its end.
    void join(i64 start, i64 len) {
        auto next = by_start_.lower_bound(start);
        if (next != by_start_.begin()) {
            auto prev = std::prev(next);
            if (prev->first + prev->second == start) {
                i64 ps = prev->first, pl = prev->second;
                remove(ps, pl);
                start = ps;
                len += pl;
            }
        }
        next = by_start_.find(start + len);
        if (next != by_start_.end()) {
            i64 nl = next->second;
            remove(start + len, nl);
            len += nl;
        }
        add(start, len);
    }

    i64 n_;
    i64 count_ = 0;
    std::map<i64, i64> by_start_;
    std::set<Run> by_len_;
};

}  // namespace tkv
