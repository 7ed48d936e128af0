// One tier's bookkeeping: key -> slot, slot states, pins, the free runs, the policy and the cold list.
//
// States: FREE -> RESERVED (a copy into the slot is in flight) -> READY (servable; in the policy's
// lists or the cold list) -> FREE. A READY slot with pins > 0 is never evicted. The cold list holds
// READY blocks worth less than anything the policy orders (copies that also live in a faster tier,
// a released session's tail): evicted first, oldest first. Every call validates its whole batch
// before it changes anything, so a refused call leaves the tier as it was.
#pragma once
#include <algorithm>

#include "domain.hpp"
#include "free_runs.hpp"
#include "keytable.hpp"

namespace tkv {

constexpr u8 FREE = 0, RESERVED = 1, READY = 2;
static_assert(READY == READY_STATE, "the domain reads tier states");

// The keys of one call seen so far, by hash (open addressing over indices): repeats in O(1) each.
class Seen {
public:
    explicit Seen(i64 n) : size_(static_cast<u64>(std::max<i64>(8, 2 * n))), at_(size_, -1), h_(size_, 0) {}
    // Whether keys[i] equals an earlier key; records it otherwise.
    bool add(const u8* const* keys, i64 i, u64 h, int kb) {
        size_t j = scale(h, size_);
        for (; at_[j] >= 0; j = j + 1 == size_ ? 0 : j + 1)
            if (h_[j] == h && std::memcmp(keys[at_[j]], keys[i], kb) == 0) return true;
        at_[j] = i;
        h_[j] = h;
        return false;
    }

private:
    u64 size_;
    std::vector<i64> at_;
    std::vector<u64> h_;
};
constexpr u16 MAX_PINS = 0xFFFF;

class Tier {
public:
    Tier(const Tier&) = delete;  // the policy holds references into its own tier's lists and hashes
    Tier& operator=(const Tier&) = delete;
    Tier(std::string name, i64 n, int key_bytes, Kind kind, const u64 seeds[4], double start, double low, double high)
        : name_(std::move(name)), n_(n), keys_(n, key_bytes, seeds[0], seeds[1], seeds[2]), state_(n, FREE),
          pins_(n, 0), free_(n), lists_(n),
          policy_(kind, n, lists_, keys_.hashes(), seeds[3], start, low, high) {}

    const std::string& name() const { return name_; }
    i64 num_slots() const { return n_; }
    KeyTable& keys() { return keys_; }
    const KeyTable& keys() const { return keys_; }
    Policy& policy() { return dom_ ? dom_->policy : policy_; }  // the hierarchy's, when attached
    const Policy& policy() const { return dom_ ? dom_->policy : policy_; }
    i64 policy_len() const { return dom_ ? lists_.size(T1) + lists_.size(T2) : policy_.size(); }
    const Lists& lists() const { return lists_; }
    u8* state_data() { return state_.data(); }
    u16* pins_data() { return pins_.data(); }
    std::shared_ptr<const void> share_state() const { return state_.share(); }
    std::shared_ptr<const void> share_pins() const { return pins_.share(); }
    u8 state(i64 s) const { return state_[s]; }
    u16 pins(i64 s) const { return pins_[s]; }
    i64 free_count() const { return free_.count(); }
    std::vector<std::pair<i64, i64>> free_runs() const { return free_.runs(); }
    i64 n_ready() const { return n_ready_; }
    i64 n_reserved() const { return n_reserved_; }
    i64 n_ready_pinned() const { return n_ready_pinned_; }
    i64 evictable() const { return n_ready_ - n_ready_pinned_; }
    i64 evicted_cold() const { return evicted_cold_; }
    i64 cold_size() const { return lists_.size(COLD); }
    bool in_cold(i64 s) const { return lists_.lid(s) == COLD; }
    size_t nbytes() const {
        return keys_.nbytes() + state_.size() + pins_.size() * sizeof(u16) + free_.nbytes() +
               lists_.nbytes() + policy_.nbytes() + (dom_ && level_ == 0 ? dom_->nbytes() : 0);
    }

    i64 find_ready(const u8* k) const {
        i64 s = keys_.find(k);
        return s >= 0 && state_[s] == READY ? s : -1;
    }

    // Free slots for the leading keys that fit (absent and distinct), RESERVED, ascending; how many.
    // The slots are the longest free runs (free_runs.hpp): as few runs of consecutive slots as can be.
    i64 reserve(const u8* const* keys, i64 m, i64* out) {
        i64 take = std::min(m, free_.count());
        if (take == 0) return 0;
        free_.take(take, out);
        try {
            insert_keys(keys, out, take, "insert");
        } catch (...) {  // the runs go back as they were (they are a function of the free slots)
            free_.give(out, take);
            throw;
        }
        for (i64 i = 0; i < take; ++i) state_[out[i]] = RESERVED;
        n_reserved_ += take;
        return take;
    }

    // Evicted slots (READY, in no list, unpinned) handed to new keys, RESERVED.
    void reassign(const i64* s, i64 m, const u8* const* keys) {
        expect(s, m, READY, "reassign");
        for (i64 i = 0; i < m; ++i) {
            if (pins_[s[i]]) fail(Err::Tier, name_ + ": cannot reassign pinned slots");
            if (lists_.lid(s[i]) != NO_LIST) fail(Err::Tier, name_ + ": reassign of slot " + S(s[i]) + ", which was not evicted");
        }
        distinct(s, m, "reassign");
        const int kb = keys_.key_bytes();
        std::vector<u8> old(static_cast<size_t>(m) * kb);
        for (i64 i = 0; i < m; ++i) {
            std::memcpy(old.data() + i * kb, keys_.key_at(s[i]), kb);
            keys_.remove(s[i]);
        }
        try {
            insert_keys(keys, s, m, "insert");
        } catch (...) {  // put the old keys back: nothing changes
            for (i64 i = 0; i < m; ++i) {
                const u8* k = old.data() + i * kb;
                keys_.insert_h(k, keys_.hash(k), s[i]);
            }
            throw;
        }
        for (i64 i = 0; i < m; ++i) state_[s[i]] = RESERVED;
        n_ready_ -= m;
        n_reserved_ += m;
    }

    // The slots' bytes have landed: READY and tracked; the LAST slot ends most recent.
    void commit(const i64* s, i64 m) {
        if (!m) return;
        live("commit");
        expect(s, m, RESERVED, "commit");
        distinct(s, m, "commit");
        i64 pinned = 0;
        for (i64 i = 0; i < m; ++i) {
            state_[s[i]] = READY;
            pinned += pins_[s[i]] != 0;
        }
        n_reserved_ -= m;
        n_ready_ += m;
        n_ready_pinned_ += pinned;
        if (dom_) return commit_in_domain(s, m);
        policy_.insert(s, m);
    }

    // RESERVED slots whose copy failed, was cancelled or never started: their keys go, the slots are free.
    void abort(const i64* s, i64 m) {
        if (!m) return;
        live("abort");
        expect(s, m, RESERVED, "abort");
        for (i64 i = 0; i < m; ++i)
            if (pins_[s[i]]) fail(Err::Tier, name_ + ": cannot abort pinned slots");
        distinct(s, m, "abort");
        for (i64 i = 0; i < m; ++i) {
            if (dom_ && dom_->lists.lid(node(s[i])) != NO_LIST) dom_->lists.unlink(node(s[i]));  // a spill that failed
            keys_.remove(s[i]);
            state_[s[i]] = FREE;
        }
        n_reserved_ -= m;
        push_free(s, m);
    }

    // Forget READY, unpinned blocks (evicted, corrupt, replaced); their slots become free.
    void drop(const i64* s, i64 m) {
        if (!m) return;
        live("drop");
        expect(s, m, READY, "drop");
        for (i64 i = 0; i < m; ++i)
            if (pins_[s[i]]) fail(Err::Tier, name_ + ": cannot drop pinned slots");
        distinct(s, m, "drop");
        for (i64 i = 0; i < m; ++i) {
            if (lists_.lid(s[i]) != NO_LIST) lists_.unlink(s[i]);
            if (dom_ && dom_->lists.lid(node(s[i])) != NO_LIST) dom_->lists.unlink(node(s[i]));
            keys_.remove(s[i]);
            state_[s[i]] = FREE;
        }
        n_ready_ -= m;
        push_free(s, m);
    }

    // Exactly n unpinned READY victims (cold list first, then the policy), out of every list but still
    // READY; or none. evicted_cold() says how many leading ones came from the cold list.
    void evict(i64 n, std::vector<i64>& out) {
        evicted_cold_ = 0;
        out.clear();
        if (n <= 0 || n > evictable()) return;
        live("evict");
        PinView pins{reinterpret_cast<const u8*>(pins_.data()), 2};
        // The cold candidates leave their list only once the policy's share is found: a refused
        // evict (victims of an earlier call still outstanding, counted as evictable) changes nothing.
        if (lists_.size(COLD)) lists_.candidates(COLD, n, pins, out);
        i64 cold = static_cast<i64>(out.size());
        if (cold < n) {
            if (dom_) {
                domain_evict(n - cold, n);
            } else if (!policy_.evict(n - cold, pins, victims_)) {
                out.clear();
                fail(Err::Tier, name_ + ": evict(" + S(n) + "): " + S(evictable()) + " evictable slots counted but only " +
                                    S(cold) + " cold and fewer than " + S(n - cold) + " in the policy found (victims of an earlier evict still outstanding?)");
            }
        }
        for (i64 i = 0; i < cold; ++i) lists_.unlink(out[i]);
        if (cold < n) out.insert(out.end(), victims_.begin(), victims_.end());
        evicted_cold_ = cold;
    }

    // READY slots become the first eviction candidates (oldest first in array order); `loaded`: they
    // were hits that moved up to a faster tier (the window remembers them). Cold ones stay where they are.
    void demote(const i64* s, i64 m, bool loaded) {
        live("demote");
        std::vector<i64> keep;
        keep.reserve(static_cast<size_t>(m));
        for (i64 i = 0; i < m; ++i)
            if (state_[s[i]] == READY && lists_.lid(s[i]) != COLD) keep.push_back(s[i]);
        distinct(keep.data(), static_cast<i64>(keep.size()), "demote");
        if (dom_) {
            for (i64 x : keep) {
                if (lists_.lid(x) == NO_LIST) continue;
                lists_.unlink(x);
                dom_->lists.unlink(node(x));
                if (loaded) dom_->hot(keys_.hashes()[x]);  // its history goes with the block
            }
        } else if (loaded) {
            policy_.demote(keep.data(), static_cast<i64>(keep.size()));
        } else {
            policy_.remove(keep.data(), static_cast<i64>(keep.size()));
        }
        for (i64 x : keep) lists_.push_back(COLD, x);
    }

    // A batch names distinct slots (a repeat could step a count past MAX_PINS unchecked).
    void pin(const i64* s, i64 m) {
        distinct(s, m, "pin");
        for (i64 i = 0; i < m; ++i)  // a pinned FREE slot could never be aborted once reserved again
            if (state_[s[i]] == FREE) fail(Err::Tier, name_ + ": pin of slot " + S(s[i]) + ", which is FREE (holds no block)");
        check_pinnable(s, m);
        for (i64 i = 0; i < m; ++i) {
            if (pins_[s[i]] == 0 && state_[s[i]] == READY) ++n_ready_pinned_;
            ++pins_[s[i]];
        }
    }

    void unpin(const i64* s, i64 m) {
        distinct(s, m, "unpin");
        for (i64 i = 0; i < m; ++i)
            if (pins_[s[i]] == 0) fail(Err::Tier, name_ + ": unpin of a slot that is not pinned");
        for (i64 i = 0; i < m; ++i) {
            if (--pins_[s[i]] == 0 && state_[s[i]] == READY) --n_ready_pinned_;
        }
    }

    // Record hits; the LAST slot ends most recent. Cold slots go back to the policy first (ascending).
    void touch(const i64* s, i64 m) {
        live("touch");
        if (lists_.size(COLD)) {
            std::vector<i64> cold;
            for (i64 i = 0; i < m; ++i)
                if (lists_.lid(s[i]) == COLD) cold.push_back(s[i]);
            if (!cold.empty()) {
                std::sort(cold.begin(), cold.end());
                cold.erase(std::unique(cold.begin(), cold.end()), cold.end());
                for (i64 x : cold) lists_.unlink(x);
                policy_insert(cold.data(), static_cast<i64>(cold.size()));
            }
        }
        if (!dom_) return policy_.touch(s, m);
        std::vector<i64> at(s, s + m);
        for (i64& x : at) x = node(x);
        dom_->policy.touch(at.data(), m);
        for (i64 i = 0; i < m; ++i)  // the mirror follows in the same order
            if (lists_.lid(s[i]) == T1 || lists_.lid(s[i]) == T2) lists_.move_back(dom_->lists.lid(at[i]), s[i]);
    }

    // Blocks recovered from persistent storage, oldest first, into an empty index.
    void restore(const u8* const* keys, const i64* s, i64 m);

    // prepare_store for a tier with nothing below it (no spill), as one call: which keys are new
    // (not READY, not in flight, not repeating an earlier key of the call), their reserved slots,
    // then for the rest the victims' slots (cold list first), evicted while the call's own resident
    // blocks and its prefix's are pinned, and reassigned to them in ascending order. `evicted` gets
    // the victims' keys in eviction order; `counts` = {deduped, in_flight}.
    void plan_store(const u8* const* keys, i64 n, const u8* const* prefix, i64 np, std::vector<i64>& new_idx,
                    std::vector<i64>& slots, std::vector<u8>& evicted, i64 counts[2]);

    // prepare_load for a tier with nothing below it, as one call: the keys before the first repeat
    // (`cut`), their leading run of READY blocks (slots pinned, into `slots`), and whether the key
    // that ends the run is in flight (RESERVED).
    bool plan_load(const u8* const* keys, i64 n, std::vector<i64>& slots, i64& cut);

    // The leading run of keys READY or in flight over this tier and `below` (may be null), stopping at
    // the first miss; counts[0..1] = how many of the run are READY here / READY below.
    i64 leading_run(const Tier* below, const u8* const* keys, i64 n, i64 counts[2]) const;

    // Raises unless every slot is accounted for exactly once.
    void check() const;

    // -- one policy over the hierarchy (domain.hpp) ------------------------------------------------
    // `cpu` and `disk` join `d` as its levels 0 and 1: both are checked before either changes, so a
    // refused attach leaves all three as they were. The binding ties the domain's lifetime to the
    // tiers'; a tier that goes first detaches (~Tier) and the other then refuses the domain's calls.
    static void attach_pair(Domain& d, Tier& cpu, Tier& disk);
    ~Tier() {
        if (!dom_) return;
        dom_->lost = true;  // the other tier refuses every call that reads the domain from now on
        dom_->pins.state[level_] = nullptr;
        dom_->pins.pins[level_] = nullptr;
        if (other_) other_->other_ = nullptr;
    }

private:
    void check_attach(const Domain& d, int level) const;
    void attach(Domain& d, int level, Tier* other);
    // Refuses when the hierarchy's other tier was freed (its states, pins and keys are gone).
    void live(const char* op) const;

public:
    bool in_domain() const { return dom_ != nullptr; }
    const Domain* domain() const { return dom_; }

    // Policy insert of READY slots (the LAST most recent), through the hierarchy's policy when attached.
    void policy_insert(const i64* s, i64 m);
    // Up to n policy victims among this tier's blocks (unpinned, READY), out of the lists.
    void policy_evict(i64 n, std::vector<i64>& out);

    // References to keys no tier of the hierarchy holds (the engine's GPU has them): their history.
    void note(const u8* const* keys, i64 m);

    // This tier's nodes in the hierarchy's eviction order (tests and debugging).
    std::vector<i64> domain_order() const;

    // n CPU slots for new keys (level 0, attached): READY, unpinned, out of every list, to be reassigned.
    // Cold blocks go first (dropped). Then, one slot at a time: if the tier below can take a block (a free
    // slot, a cold block to drop, or a clean copy of it already), the CPU block the policy ranks first
    // among the CPU's moves down, keeping its rank; else the policy's next victim leaves the hierarchy (a
    // CPU one frees its slot; a disk one makes room below). `spill` false (no writable tier below): the
    // CPU's first-ranked blocks leave. Out: victims (CPU slots; the first evicted_cold() from the cold
    // list), spill_cpu / spill_disk (dirty moves: disk slots RESERVED for their keys), gone_disk (keys of
    // disk blocks that left, for the caller's events), dropped (the victims that left the CPU without a
    // spill: cold, clean moves, the hierarchy's victims); returns how many victims are clean moves.
    i64 make_room(i64 n, bool spill, std::vector<i64>& victims, std::vector<i64>& dropped, std::vector<i64>& spill_cpu,
                  std::vector<i64>& spill_disk, std::vector<u8>& gone_disk);

private:
    i64 node(i64 s) const { return base_ + s; }

    void commit_in_domain(const i64* s, i64 m);

    // n policy victims among this tier's blocks into victims_, out of both lists.
    void domain_evict(i64 n, i64 asked);

    // Slots in range and in state `want`, and their keys agree (a RESERVED or READY slot holds one).
    void expect(const i64* s, i64 m, u8 want, const char*) const;
    void check_pinnable(const i64* s, i64 m) const;
    void distinct(const i64* s, i64 m, const char* op) const;
    // Insert keys[i] at slots[i] (slots empty): every key absent and distinct, else nothing changes.
    void insert_keys(const u8* const* keys, const i64* slots, i64 m, const char* op);
    // Undo the last reserve() of these m slots (nothing happened since): keys out, FREE, and back in
    // the free runs, which are then as reserve() found them (runs are maximal: one set, one map).
    void unreserve(const i64* s, i64 m);
    void push_free(const i64* s, i64 m);

    std::string name_;
    i64 n_;
    KeyTable keys_;
    SharedArray<u8> state_;  // the state and pins views share these
    SharedArray<u16> pins_;
    FreeRuns free_;
    Lists lists_;
    Policy policy_;
    Domain* dom_ = nullptr;  // the hierarchy's policy, when the tier is part of one
    int level_ = 0;
    i64 base_ = 0;
    Tier* other_ = nullptr;  // the hierarchy's other tier
    i64 n_reserved_ = 0, n_ready_ = 0, n_ready_pinned_ = 0, evicted_cold_ = 0;
    std::vector<i64> victims_, one_;
};

}  // namespace tkv

#include "tier_plans.hpp"  // restore, the one-call plans and the invariant check, defined out of the class
#include "tier_domain.hpp"  // the hierarchy methods, likewise
