// One eviction policy over a hierarchy of tiers (CPU above disk): recency, frequency and ghosts
// belong to a key, not to the tier that holds it.
//
// The policy's lists run over positions: CPU slot s is node s, disk slot d is node split + d. A
// block that moves down keeps its node's rank (Lists::replace), so spilling a block neither ages nor
// refreshes it; what leaves the hierarchy is the policy's victim wherever it lives. Each tier keeps
// its own lists mirroring the policy's for its blocks, in the same order (the CPU's decide what
// spills: the policy's rule applied to the CPU's blocks alone), plus its cold list. `history` holds
// tags of keys referenced while no tier held them (in the engine's GPU): list 0 seen once, list 1
// seen again, so such a block enters the frequent list when the engine hands it down.
#pragma once
#include "policy.hpp"

namespace tkv {

constexpr u8 READY_STATE = 2;  // tier.hpp's READY (the domain reads the tiers' states)

// A node is a candidate when its tier holds it READY and unpinned; `only` (0 / 1) limits to one tier.
struct DomainPins {
    const u8* state[2] = {nullptr, nullptr};
    const u16* pins[2] = {nullptr, nullptr};
    i64 split = 0;
    int only = -1;
    bool pinned(i64 p) const {
        int t = p >= split;
        if (only >= 0 && t != only) return true;
        i64 s = t ? p - split : p;
        return state[t][s] != READY_STATE || pins[t][s] != 0;
    }
};

class Domain {
public:
    Domain(const Domain&) = delete;  // the policy refers to its own lists, tags and history
    Domain& operator=(const Domain&) = delete;
    Domain(Kind kind, i64 cpu_slots, i64 disk_slots, u64 mult, double start, double low, double high)
        : split(cpu_slots), lists(cpu_slots + disk_slots), tags(static_cast<size_t>(cpu_slots + disk_slots), 0),
          history(kind == Kind::LRU ? 0 : cpu_slots + disk_slots, mult ^ 0x9E3779B97F4A7C15ULL),
          policy(kind, cpu_slots + disk_slots, lists, tags.data(), mult, start, low, high,
                 kind == Kind::LRU ? nullptr : &history) {}

    i64 split;
    Lists lists;
    std::vector<u64> tags;
    Ghosts history;
    Policy policy;
    DomainPins pins;  // filled in when the tiers attach
    bool attached[2] = {false, false};
    bool lost = false;  // a tier was freed while attached: the other refuses what reads the domain

    size_t nbytes() const { return lists.nbytes() + tags.size() * sizeof(u64) + history.nbytes() + policy.nbytes(); }

    // A reference to a key no tier here holds: seen once, or seen again (kept newest, bounded).
    void note(u64 tag) {
        if (history.capacity() == 0) return;
        i32 g = history.find(tag);
        int l = 0;
        if (g >= 0) {
            l = 1;
            history.discard(g);
        }
        push_history(l, tag);
    }
    // A block that moved up to the engine on a hit: when it comes down again it is frequent.
    void hot(u64 tag) {
        if (history.capacity() == 0) return;
        i32 g = history.find(tag);
        if (g >= 0) history.discard(g);
        push_history(1, tag);
    }

private:
    void push_history(int l, u64 tag) {
        if (history.size(0) + history.size(1) >= history.capacity())
            history.pop_oldest(history.size(0) ? 0 : 1);
        history.push(l, tag);
    }
};

}  // namespace tkv
