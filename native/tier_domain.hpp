// Tier's methods for one policy over the CPU and disk tiers (domain.hpp): declared in tier.hpp's class, defined
// here to keep each header small. Included at the end of tier.hpp, not on its own.
#pragma once

namespace tkv {

inline void Tier::attach_pair(Domain& d, Tier& cpu, Tier& disk) {
    if (&cpu == &disk) fail(Err::Tier, cpu.name_ + ": one tier cannot be both levels of a hierarchy");
    if (cpu.keys_.key_bytes() != disk.keys_.key_bytes())
        fail(Err::Tier, "a hierarchy's tiers need one key length: " + cpu.name_ + " has " + S(cpu.keys_.key_bytes()) +
                            " bytes, " + disk.name_ + " " + S(disk.keys_.key_bytes()));
    cpu.check_attach(d, 0);
    disk.check_attach(d, 1);
    cpu.attach(d, 0, &disk);
    disk.attach(d, 1, &cpu);
}

inline void Tier::check_attach(const Domain& d, int level) const {
    if (dom_) fail(Err::Tier, name_ + ": the tier is already part of a hierarchy");
    if (n_ready_ || n_reserved_)
        fail(Err::Tier, name_ + ": a tier joins a hierarchy while empty (it holds " + S(n_ready_) + " READY and " +
                            S(n_reserved_) + " RESERVED slots)");
    if (d.attached[level]) fail(Err::Tier, name_ + ": the hierarchy already has a level " + S(level) + " tier");
    if (d.lost) fail(Err::Tier, name_ + ": the hierarchy lost a tier");
    i64 want = level == 0 ? d.split : static_cast<i64>(d.tags.size()) - d.split;
    if (want != n_) fail(Err::Tier, name_ + ": the hierarchy has " + S(want) + " slots at level " + S(level) + ", the tier " + S(n_));
}

inline void Tier::attach(Domain& d, int level, Tier* other) {
    dom_ = &d;
    level_ = level;
    base_ = level == 0 ? 0 : d.split;
    other_ = other;
    d.attached[level] = true;
    d.pins.state[level] = state_.data();
    d.pins.pins[level] = pins_.data();
    d.pins.split = d.split;
}

inline void Tier::live(const char* op) const {
    if (dom_ && dom_->lost)
        fail(Err::Tier, name_ + ": " + op + ": the hierarchy's other tier was freed; this tier cannot use the shared policy");
}

inline void Tier::policy_insert(const i64* s, i64 m) {
    live("policy_insert");
    expect(s, m, READY, "policy_insert");
    distinct(s, m, "policy_insert");
    for (i64 i = 0; i < m; ++i) {  // a slot in two lists (the cold list and the policy's) breaks both
        if (lists_.lid(s[i]) != NO_LIST)
            fail(Err::Tier, name_ + ": policy_insert of slot " + S(s[i]) + ", which is in list " + S(lists_.lid(s[i])) +
                                (lists_.lid(s[i]) == COLD ? " (the cold list)" : " (the policy's)"));
        if (dom_ && dom_->lists.lid(node(s[i])) != NO_LIST)
            fail(Err::Tier, name_ + ": policy_insert of slot " + S(s[i]) + ", which the hierarchy's policy already holds");
    }
    if (!dom_) return policy_.insert(s, m);
    std::vector<i64> at(s, s + m);
    for (i64 i = 0; i < m; ++i) {
        at[i] = node(s[i]);
        dom_->tags[static_cast<size_t>(at[i])] = keys_.hashes()[s[i]];
    }
    dom_->policy.insert(at.data(), m);
    for (i64 i = 0; i < m; ++i) lists_.push_back(dom_->lists.lid(at[i]), s[i]);
}

inline void Tier::policy_evict(i64 n, std::vector<i64>& out) {
    out.clear();
    live("policy_evict");
    if (!dom_) {
        PinView pins{reinterpret_cast<const u8*>(pins_.data()), 2};
        policy_.evict(n, pins, out);
        return;
    }
    domain_evict(n, n);
    out = victims_;
}

inline void Tier::note(const u8* const* keys, i64 m) {
    if (!dom_) return;
    live("note");
    for (i64 i = 0; i < m; ++i) {
        if (keys_.find(keys[i]) >= 0 || (other_ && other_->keys_.find(keys[i]) >= 0)) continue;
        dom_->note(keys_.hash(keys[i]));
    }
}

inline std::vector<i64> Tier::domain_order() const {
    live("policy_order");
    std::vector<i64> out;
    for (i64 p : dom_->policy.order())
        if ((p >= dom_->split) == (level_ == 1)) out.push_back(p - base_);
    return out;
}

inline i64 Tier::make_room(i64 n, bool spill, std::vector<i64>& victims, std::vector<i64>& dropped, std::vector<i64>& spill_cpu,
              std::vector<i64>& spill_disk, std::vector<u8>& gone_disk) {
    if (!dom_ || level_ != 0) fail(Err::Tier, name_ + ": make_room needs the CPU tier of a hierarchy");
    live("make_room");
    Tier* below = spill ? other_ : nullptr;
    victims.clear();
    dropped.clear();
    spill_cpu.clear();
    spill_disk.clear();
    gone_disk.clear();
    evicted_cold_ = 0;
    n = std::min(n, evictable());
    if (n <= 0) return 0;
    PinView pins{reinterpret_cast<const u8*>(pins_.data()), 2};
    if (lists_.size(COLD)) {
        lists_.candidates(COLD, n, pins, victims);
        for (i64 x : victims) lists_.unlink(x);
    }
    evicted_cold_ = static_cast<i64>(victims.size());
    dropped = victims;
    const int kb = keys_.key_bytes();
    DomainPins all = dom_->pins;
    all.only = -1;
    i64 clean = 0;
    while (static_cast<i64>(victims.size()) < n) {
        i64 c = dom_->policy.next_in(lists_, pins);
        if (c < 0) break;  // cannot happen (n <= evictable); the caller sees fewer
        if (!below) {
            lists_.unlink(c);
            dom_->policy.evict_node(node(c));
            victims.push_back(c);
            dropped.push_back(c);
            continue;
        }
        const u8* key = keys_.key_at(c);
        i64 dup = below->find_ready(key);
        if (dup < 0 && below->keys_.find(key) >= 0) dup = -2;  // RESERVED below: a copy in flight down
        if (dup == -2 || (dup >= 0 && below->lists_.lid(dup) != COLD)) {
            // The disk holds the key with a rank (or a copy in flight) of its own: reserving it there
            // would refuse half way through this call, so the CPU block leaves as a clean drop (no
            // ghost: its key stays in the hierarchy) and the copy below keeps its own rank.
            lists_.unlink(c);
            dom_->lists.unlink(node(c));
            victims.push_back(c);
            dropped.push_back(c);
            ++clean;
            continue;
        }
        if (dup >= 0) {  // a clean copy below (cold) takes the block's rank
            lists_.unlink(c);
            below->lists_.unlink(dup);
            dom_->lists.replace(node(c), below->node(dup));
            dom_->tags[static_cast<size_t>(below->node(dup))] = dom_->tags[static_cast<size_t>(node(c))];
            below->lists_.push_back(dom_->lists.lid(below->node(dup)), dup);
            victims.push_back(c);
            dropped.push_back(c);
            ++clean;
            continue;
        }
        i64 d = -1;
        if (below->free_.count() > 0) {
            below->reserve(&key, 1, &d);
        } else {
            PinView bpins{reinterpret_cast<const u8*>(below->pins_.data()), 2};
            d = below->lists_.first_unpinned(COLD, bpins);
            if (d >= 0) {
                below->lists_.unlink(d);
            } else {
                if (!dom_->policy.evict(1, all, one_)) break;  // nothing unpinned anywhere
                i64 p = one_[0];
                if (p < dom_->split) {  // a CPU block leaves: its slot is the room
                    lists_.unlink(p);
                    victims.push_back(p);
                    dropped.push_back(p);
                    continue;
                }
                d = p - dom_->split;
                below->lists_.unlink(d);
            }
            gone_disk.insert(gone_disk.end(), below->keys_.key_at(d), below->keys_.key_at(d) + kb);
            below->reassign(&d, 1, &key);
        }
        lists_.unlink(c);
        dom_->lists.replace(node(c), below->node(d));  // in flight down, keeping its rank
        dom_->tags[static_cast<size_t>(below->node(d))] = dom_->tags[static_cast<size_t>(node(c))];
        spill_cpu.push_back(c);
        spill_disk.push_back(d);
        victims.push_back(c);
    }
    return clean;
}

inline void Tier::commit_in_domain(const i64* s, i64 m) {
    std::vector<i64> fresh;
    fresh.reserve(static_cast<size_t>(m));
    for (i64 i = 0; i < m; ++i) {
        u8 g = dom_->lists.lid(node(s[i]));
        if (g != NO_LIST) lists_.push_back(g, s[i]);  // a spill landed: it kept its rank
        else if (level_ == 1 && other_ && other_->keys_.find(keys_.key_at(s[i])) >= 0)
            lists_.push_back(COLD, s[i]);  // a copy of a block the CPU holds (written through)
        else fresh.push_back(s[i]);
    }
    policy_insert(fresh.data(), static_cast<i64>(fresh.size()));
}

inline void Tier::domain_evict(i64 n, i64 asked) {
    DomainPins only = dom_->pins;
    only.only = level_;
    if (!dom_->policy.evict(n, only, victims_))
        fail(Err::Tier, name_ + ": evict(" + S(asked) + "): " + S(evictable()) + " evictable slots counted but fewer than " +
                            S(n) + " found in the hierarchy's policy (victims of an earlier evict still outstanding?)");
    for (i64& p : victims_) {
        p -= base_;
        lists_.unlink(p);
    }
}

}  // namespace tkv
