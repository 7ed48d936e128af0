// Recency lists over slot ids, and the ghost lists of evicted keys' tags.
//
// Lists: doubly linked lists threaded through two int32 arrays shared by every list of a tier
// (a slot is in at most one: the policy's one or two lists, or the tier's cold list), so moving a
// slot to the most recent end is O(1) and costs 9 bytes per slot for all lists together.
// Index num_slots + l is list l's sentinel: next[sentinel] is the oldest entry, prev[] the newest.
#pragma once
#include "common.hpp"

namespace tkv {

constexpr u8 NO_LIST = 0;
constexpr int NLISTS = 4;  // 1, 2: the policy's lists; 3: the tier's cold list (0: in none)
constexpr u8 COLD = 3;

class Lists {
public:
    explicit Lists(i64 n) : n_(n), prev_(n + NLISTS), next_(n + NLISTS), lid_(n, NO_LIST) {
        for (int l = 0; l < NLISTS; ++l) prev_[n + l] = next_[n + l] = static_cast<i32>(n + l);
    }
    u8 lid(i64 s) const { return lid_[s]; }
    i64 size(u8 l) const { return size_[l]; }
    i32 first(u8 l) const { return next_[n_ + l]; }
    i32 after(i32 s) const { return next_[s]; }
    bool end(u8 l, i32 s) const { return s == n_ + l; }
    size_t nbytes() const { return (prev_.size() + next_.size()) * sizeof(i32) + lid_.size(); }

    void push_back(u8 l, i64 s) {
        i32 sent = static_cast<i32>(n_ + l), last = prev_[sent];
        next_[last] = static_cast<i32>(s);
        prev_[s] = last;
        next_[s] = sent;
        prev_[sent] = static_cast<i32>(s);
        lid_[s] = l;
        ++size_[l];
    }
    void unlink(i64 s) {
        u8 l = lid_[s];
        next_[prev_[s]] = next_[s];
        prev_[next_[s]] = prev_[s];
        lid_[s] = NO_LIST;
        --size_[l];
    }
    void move_back(u8 l, i64 s) {
        unlink(s);
        push_back(l, s);
    }
    // Node `to` (in no list) takes node `from`'s place in its list: a block that moved keeps its rank.
    void replace(i64 from, i64 to) {
        u8 l = lid_[from];
        i32 p = prev_[from], x = next_[from];
        next_[p] = static_cast<i32>(to);
        prev_[x] = static_cast<i32>(to);
        prev_[to] = p;
        next_[to] = x;
        lid_[to] = l;
        lid_[from] = NO_LIST;
    }
    // The oldest unpinned member of list l, -1 if none (read-only).
    template <class Pins>
    i64 first_unpinned(u8 l, const Pins& pins) const {
        for (i32 s = first(l); !end(l, s); s = next_[s])
            if (!pins.pinned(s)) return s;
        return -1;
    }
    // Up to `want` unpinned members of list l, oldest first (read-only).
    template <class Pins>
    void candidates(u8 l, i64 want, const Pins& pins, std::vector<i64>& out) const {
        out.clear();
        for (i32 s = first(l); !end(l, s) && static_cast<i64>(out.size()) < want; s = next_[s])
            if (!pins.pinned(s)) out.push_back(s);
    }
    std::vector<i64> members(u8 l) const {
        std::vector<i64> out;
        for (i32 s = first(l); !end(l, s); s = next_[s]) out.push_back(s);
        return out;
    }
    // Raises unless the policy lists' links and sizes agree (a domain's lists: no cold list, any node).
    void check_range(i64, i64) const {
        for (u8 l = 1; l < COLD; ++l) {
            i64 k = 0;
            for (i32 s = first(l); !end(l, s); s = next_[s])
                if (s < 0 || s >= n_ || lid_[s] != l || next_[prev_[s]] != s || ++k > n_)
                    fail(Err::Tier, "hierarchy list " + S(l) + " is broken at node " + S(s));
            if (k != size_[l]) fail(Err::Tier, "hierarchy list " + S(l) + " holds " + S(k) + ", counted " + S(size_[l]));
        }
    }
    // Raises unless each list's links, sizes and membership bytes agree.
    void check() const {
        i64 counted[NLISTS] = {0, 0, 0, 0};
        for (u8 l = 1; l < NLISTS; ++l) {
            i64 k = 0;
            for (i32 s = first(l); !end(l, s); s = next_[s]) {
                if (s < 0 || s >= n_ || lid_[s] != l || next_[prev_[s]] != s || ++k > n_)
                    fail(Err::Tier, "list " + S(l) + " is broken at slot " + S(s));
            }
            if (k != size_[l]) fail(Err::Tier, "list " + S(l) + " holds " + S(k) + " slots, counted " + S(size_[l]));
        }
        for (i64 s = 0; s < n_; ++s) ++counted[lid_[s]];
        for (u8 l = 1; l < NLISTS; ++l)
            if (counted[l] != size_[l]) fail(Err::Tier, "list " + S(l) + ": membership bytes disagree with its size");
    }

private:
    i64 n_;
    std::vector<i32> prev_, next_;
    std::vector<u8> lid_;
    i64 size_[NLISTS] = {0, 0, 0, 0};
};

// Ghosts: the tags of recently evicted keys in two lists (0 and 1), oldest first, found by tag.
// A pool of nodes (tag, links, list) and an open-addressing tag -> node table (2 entries per node,
// backward-shift deletion): 8 + 8 + 1 + 8 = 25 bytes per ghost at the bound.
class Ghosts {
public:
    explicit Ghosts(i64 capacity, u64 mult)
        : cap_(capacity), mult_(mult | 1), tag_(capacity), prev_(capacity + 2), next_(capacity + 2),
          lid_(capacity, 0), tsize_(static_cast<u64>(std::max<i64>(8, 2 * capacity))), table_(tsize_, -1) {
        for (int l = 0; l < 2; ++l) prev_[cap_ + l] = next_[cap_ + l] = static_cast<i32>(cap_ + l);
        for (i64 i = 0; i < cap_; ++i) next_[i] = static_cast<i32>(i + 1 < cap_ ? i + 1 : -1);
        free_ = cap_ ? 0 : -1;
    }
    i64 size(int l) const { return size_[l]; }
    i64 capacity() const { return cap_; }
    size_t nbytes() const {
        return tag_.size() * sizeof(u64) + (prev_.size() + next_.size()) * sizeof(i32) + lid_.size() +
               table_.size() * sizeof(i32);
    }

    // The node holding `tag`, -1 if it is no ghost.
    i32 find(u64 tag) const {
        size_t i = slot_of(tag);
        for (;;) {
            i32 g = table_[i];
            if (g < 0) return -1;
            if (tag_[g] == tag) return g;
            if (++i == tsize_) i = 0;
        }
    }
    int list_of(i32 g) const { return lid_[g]; }

    void discard(i32 g) {
        unlink(g);
        untable(g);
        next_[g] = free_;
        free_ = g;
    }
    // Add at the newest end of list l (the pool has room: callers trim first or right after).
    void push(int l, u64 tag) {
        i32 g = free_;
        if (g < 0) fail(Err::Tier, "ghost pool overflow (" + S(cap_) + " ghosts)");
        free_ = next_[g];
        tag_[g] = tag;
        lid_[g] = static_cast<u8>(l);
        i32 sent = static_cast<i32>(cap_ + l), last = prev_[sent];
        next_[last] = g;
        prev_[g] = last;
        next_[g] = sent;
        prev_[sent] = g;
        ++size_[l];
        size_t i = slot_of(tag);
        while (table_[i] >= 0)
            if (++i == tsize_) i = 0;
        table_[i] = g;
    }
    void pop_oldest(int l) { discard(next_[cap_ + l]); }

    std::vector<u64> tags(int l) const {
        std::vector<u64> out;
        for (i32 g = next_[cap_ + l]; g != cap_ + l; g = next_[g]) out.push_back(tag_[g]);
        return out;
    }
    void check() const {
        i64 k[2] = {0, 0};
        for (int l = 0; l < 2; ++l)
            for (i32 g = next_[cap_ + l]; g != cap_ + l; g = next_[g]) {
                if (g < 0 || g >= cap_ || lid_[g] != l || ++k[l] > cap_) fail(Err::Tier, "ghost list " + S(l) + " is broken");
                if (find(tag_[g]) != g) fail(Err::Tier, "a ghost is not found by its tag");
            }
        if (k[0] != size_[0] || k[1] != size_[1]) fail(Err::Tier, "ghost list sizes drifted");
        i64 entries = 0;
        for (size_t i = 0; i < tsize_; ++i) entries += table_[i] >= 0;
        if (entries != k[0] + k[1]) fail(Err::Tier, "ghost table holds " + S(entries) + " entries for " + S(k[0] + k[1]) + " ghosts");
    }

private:
    size_t slot_of(u64 tag) const { return scale(tag * mult_, tsize_); }
    void unlink(i32 g) {
        next_[prev_[g]] = next_[g];
        prev_[next_[g]] = prev_[g];
        --size_[lid_[g]];
    }
    void untable(i32 g) {
        size_t i = slot_of(tag_[g]);
        while (table_[i] != g)
            if (++i == tsize_) i = 0;
        table_[i] = -1;
        size_t j = i;
        for (;;) {
            if (++j == tsize_) j = 0;
            i32 h = table_[j];
            if (h < 0) return;
            size_t home = slot_of(tag_[h]);
            bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                table_[i] = h;
                table_[j] = -1;
                i = j;
            }
        }
    }

    i64 cap_;
    u64 mult_;
    std::vector<u64> tag_;
    std::vector<i32> prev_, next_;
    std::vector<u8> lid_;
    u64 tsize_;
    std::vector<i32> table_;
    i32 free_ = -1;
    i64 size_[2] = {0, 0};
};

}  // namespace tkv
