// Tier's restore, its one-call plans (plan_store, plan_load, leading_run), its invariant check and private helpers: declared in
// tier.hpp's class, defined here to keep each header small. Included at the end of tier.hpp, not on its own.
#pragma once

namespace tkv {

inline void Tier::restore(const u8* const* keys, const i64* s, i64 m) {
    live("restore");
    if (n_ready_ || n_reserved_) fail(Err::Tier, name_ + ": restore needs an empty index");
    for (i64 i = 0; i < m; ++i)
        if (s[i] < 0 || s[i] >= n_) fail(Err::Tier, name_ + ": recovered slots are out of range or used twice");
    {
        std::vector<i64> sorted(s, s + m);
        std::sort(sorted.begin(), sorted.end());
        if (std::adjacent_find(sorted.begin(), sorted.end()) != sorted.end())
            fail(Err::Tier, name_ + ": recovered slots are out of range or used twice");
    }
    std::vector<i64> slots(s, s + m);
    insert_keys(keys, slots.data(), m, "insert");
    std::vector<u8> used(static_cast<size_t>(n_), 0);
    for (i64 i = 0; i < m; ++i) {
        state_[s[i]] = READY;
        used[static_cast<size_t>(s[i])] = 1;
    }
    n_ready_ = m;
    policy_insert(s, m);
    free_.reset(used.data());
}

inline void Tier::plan_store(const u8* const* keys, i64 n, const u8* const* prefix, i64 np, std::vector<i64>& new_idx,
                std::vector<i64>& slots, std::vector<u8>& evicted, i64 counts[2]) {
    const int kb = keys_.key_bytes();
    std::vector<i64> found(static_cast<size_t>(n));
    std::vector<u8> resident(static_cast<size_t>(n), 0), repeated(static_cast<size_t>(n), 0);
    i64 deduped = 0, in_flight = 0;
    Seen seen(n);
    new_idx.clear();
    for (i64 i = 0; i < n; ++i) {
        u64 h = keys_.hash(keys[i]);
        i64 s = keys_.find_h(keys[i], h);
        found[i] = s;
        resident[i] = s >= 0 && state_[s] == READY;
        bool pending = s >= 0 && state_[s] == RESERVED;
        repeated[i] = seen.add(keys, i, h, kb);
        deduped += resident[i] || repeated[i];
        in_flight += pending && !repeated[i];
        if (!(resident[i] || pending || repeated[i])) new_idx.push_back(i);
    }
    counts[0] = deduped;
    counts[1] = in_flight;
    i64 m = static_cast<i64>(new_idx.size());
    std::vector<const u8*> fresh(static_cast<size_t>(m));
    for (i64 j = 0; j < m; ++j) fresh[j] = keys[new_idx[j]];
    evicted.clear();
    // All or nothing: whatever can refuse the call (pinning the held blocks) is checked before
    // the reservation, which no plan would own if a later step threw.
    std::vector<i64> held;  // the chain's resident blocks: never evicted for its own new ones
    if (m > free_.count()) {
        for (i64 i = 0; i < n; ++i)
            if (resident[i]) held.push_back(found[i]);
        for (i64 j = 0; j < np; ++j) {
            i64 s = find_ready(prefix[j]);
            if (s >= 0) held.push_back(s);
        }
        std::sort(held.begin(), held.end());
        held.erase(std::unique(held.begin(), held.end()), held.end());
        check_pinnable(held.data(), static_cast<i64>(held.size()));
    }
    slots.assign(static_cast<size_t>(std::min(m, free_.count())), 0);
    i64 got = reserve(fresh.data(), m, slots.data());
    slots.resize(static_cast<size_t>(got));
    if (got == m) return;
    pin(held.data(), static_cast<i64>(held.size()));
    std::vector<i64> victims;
    try {
        evict(std::min(m - got, evictable()), victims);  // refuses with no change (evict)
    } catch (...) {  // the reservation goes back exactly as it was taken: no slot RESERVED for no plan
        unpin(held.data(), static_cast<i64>(held.size()));
        unreserve(slots.data(), got);
        slots.clear();
        throw;
    }
    unpin(held.data(), static_cast<i64>(held.size()));
    if (victims.empty()) return;
    evicted.resize(victims.size() * static_cast<size_t>(kb));
    for (size_t v = 0; v < victims.size(); ++v) std::memcpy(evicted.data() + v * kb, keys_.key_at(victims[v]), kb);
    std::sort(victims.begin(), victims.end());
    // Cannot refuse: the victims are READY, unpinned and out of every list, the keys absent and distinct.
    reassign(victims.data(), static_cast<i64>(victims.size()), fresh.data() + got);
    slots.insert(slots.end(), victims.begin(), victims.end());
}

inline bool Tier::plan_load(const u8* const* keys, i64 n, std::vector<i64>& slots, i64& cut) {
    const int kb = keys_.key_bytes();
    Seen seen(n);
    slots.clear();
    cut = n;
    bool stopped = false, pending = false;
    for (i64 i = 0; i < n; ++i) {
        u64 h = keys_.hash(keys[i]);
        if (seen.add(keys, i, h, kb)) {
            cut = i;
            break;
        }
        if (stopped) continue;
        i64 s = keys_.find_h(keys[i], h);
        if (s >= 0 && state_[s] == READY) {
            slots.push_back(s);
            continue;
        }
        stopped = true;
        pending = s >= 0;  // a CPU entry that is not READY is RESERVED: in flight
    }
    pin(slots.data(), static_cast<i64>(slots.size()));
    return pending;
}

inline i64 Tier::leading_run(const Tier* below, const u8* const* keys, i64 n, i64 counts[2]) const {
    counts[0] = counts[1] = 0;
    for (i64 i = 0; i < n; ++i) {
        i64 s = keys_.find(keys[i]);
        if (s >= 0) {  // READY or RESERVED here: a hit either way
            counts[0] += state_[s] == READY;
            continue;
        }
        if (below) {
            i64 x = below->keys_.find(keys[i]);
            if (x >= 0) {
                counts[1] += below->state_[x] == READY;
                continue;
            }
        }
        return i;
    }
    return n;
}

inline void Tier::check() const {
    std::vector<u8> is_free(static_cast<size_t>(n_), 0);
    free_.check(is_free.data(), name_);
    i64 ready = 0, reserved = 0, pinned_ready = 0;
    for (i64 s = 0; s < n_; ++s) {
        u8 st = state_[s];
        if (is_free[s] != (st == FREE)) fail(Err::Tier, name_ + ": free list and FREE states disagree");
        if (st == FREE && pins_[s]) fail(Err::Tier, name_ + ": a FREE slot is pinned");
        if (keys_.held(s) != (st != FREE)) fail(Err::Tier, name_ + ": a slot's key and its state disagree");
        ready += st == READY;
        reserved += st == RESERVED;
        pinned_ready += st == READY && pins_[s];
        if ((lists_.lid(s) != NO_LIST) != (st == READY))
            fail(Err::Tier, name_ + ": READY slots and the policy + cold lists disagree");
    }
    if (ready != n_ready_ || reserved != n_reserved_) fail(Err::Tier, name_ + ": state counts drifted");
    if (pinned_ready != n_ready_pinned_)
        fail(Err::Tier, name_ + ": pinned READY count drifted (" + S(n_ready_pinned_) + " vs " + S(pinned_ready) + ")");
    lists_.check();
    policy_.ghosts().check();
    keys_.check();
    if (!dom_) return;
    live("check_invariants");
    // The mirror and the domain's lists agree on this tier's nodes; a node outside the mirror is
    // a block in flight down to this tier (RESERVED: its spill keeps its rank).
    for (i64 x = 0; x < n_; ++x) {
        u8 l = lists_.lid(x), g = dom_->lists.lid(node(x));
        bool mirrored = l == T1 || l == T2;
        if (mirrored ? g != l : (g != NO_LIST && state_[x] != RESERVED))
            fail(Err::Tier, name_ + ": slot " + S(x) + " is in list " + S(l) + " here but " + S(g) + " in the hierarchy's policy");
    }
    if (level_ == 0) {
        dom_->lists.check_range(0, dom_->split);
        dom_->policy.ghosts().check();
        dom_->history.check();
    }
}


// -- the private checks and the key and free-run helpers the methods share --

inline void Tier::expect(const i64* s, i64 m, u8 want, const char*) const {
    for (i64 i = 0; i < m; ++i) {
        if (s[i] < 0 || s[i] >= n_) fail(Err::Tier, name_ + ": slot " + S(s[i]) + " is outside [0, " + S(n_) + ")");
        if (state_[s[i]] != want)
            fail(Err::Tier, name_ + ": slot " + S(s[i]) + " is in state " + S(state_[s[i]]) + ", expected " + S(want));
        if (keys_.held(s[i]) != (want != FREE))
            fail(Err::Tier, name_ + ": slot " + S(s[i]) + " is in state " + S(want) + " but its key table disagrees");
    }
}

inline void Tier::check_pinnable(const i64* s, i64 m) const {
    for (i64 i = 0; i < m; ++i)
        if (pins_[s[i]] == MAX_PINS) fail(Err::Tier, name_ + ": more than " + S(MAX_PINS) + " concurrent pins on one slot");
}

inline void Tier::distinct(const i64* s, i64 m, const char* op) const {
    if (m < 2) return;
    std::vector<i64> sorted(s, s + m);
    std::sort(sorted.begin(), sorted.end());
    auto rep = std::adjacent_find(sorted.begin(), sorted.end());
    if (rep != sorted.end()) fail(Err::Tier, std::string(op) + ": slot " + S(*rep) + " appears twice in one batch");
}

inline void Tier::insert_keys(const u8* const* keys, const i64* slots, i64 m, const char* op) {
    i64 done = 0;
    try {
        for (; done < m; ++done) {
            const u8* k = keys[done];
            u64 h = keys_.hash(k);
            i64 at = keys_.find_h(k, h);
            if (at >= 0) {
                bool ours = std::find(slots, slots + done, at) != slots + done;
                fail(Err::Tier, std::string(op) + " of key " + keys_.hex(k) + " into slot " + S(slots[done]) +
                                    (ours ? ": the batch names it twice" : ": the key is already in slot " + S(at)));
            }
            keys_.insert_h(k, h, slots[done]);
        }
    } catch (...) {
        for (i64 i = 0; i < done; ++i) keys_.remove(slots[i]);
        throw;
    }
}

inline void Tier::unreserve(const i64* s, i64 m) {
    for (i64 i = 0; i < m; ++i) {
        keys_.remove(s[i]);
        state_[s[i]] = FREE;
    }
    n_reserved_ -= m;
    free_.give(s, m);
}

inline void Tier::push_free(const i64* s, i64 m) {
    if (free_.count() + m > n_) fail(Err::Tier, name_ + ": more slots freed than exist");
    free_.give(s, m);
}

}  // namespace tkv
