// The eviction policies: LRU, ARC and the adaptive window, over the tier's shared lists.
//
// Every batch call behaves exactly as its elements applied one by one in array order (the LAST
// element ends most recent). evict(n) takes exactly n unpinned tracked slots or changes nothing.
// LRU: list 1. ARC: T1 = list 1 (seen once), T2 = list 2 (hit again), ghosts B1/B2 of evicted tags,
// p = T1's adaptive target (Megiddo & Modha). Window: ARC's structure with a small FIFO window
// (list 1) whose target moves one slot per ghost hit within [low, high], main (list 2) an LRU,
// each ghost list bounded on its own (4x and 2x the slots), and demote() leaving a main ghost.
#pragma once
#include <algorithm>
#include <cmath>

#include "lists.hpp"

namespace tkv {

enum class Kind { LRU = 0, ARC = 1, WINDOW = 2 };
constexpr u8 T1 = 1, T2 = 2;  // list ids: LRU uses T1 only
constexpr i64 WINDOW_GHOSTS[2] = {4, 2};  // the window's and main's ghost bounds, in slots of the tier

inline const char* kind_name(Kind k) { return k == Kind::LRU ? "lru" : k == Kind::ARC ? "arc" : "window"; }

class Policy {
public:
    Policy(const Policy&) = delete;  // it refers to lists and tags it does not own
    Policy& operator=(const Policy&) = delete;
    // `tags` names the key each slot holds (read on insert and evict): the ghosts' identity.
    // `history` (may be null): tags of keys referenced while no tier of the hierarchy held them, list 1
    // for a key referenced again (it enters the frequent list, with no adaptation: it is no ghost hit).
    Policy(Kind kind, i64 n, Lists& lists, const u64* tags, u64 ghost_mult, double start, double low, double high,
           Ghosts* history = nullptr)
        : kind_(kind), n_(n), lists_(lists), tags_(tags), history_(history),
          ghosts_(kind == Kind::LRU ? 0 : kind == Kind::ARC ? n : (WINDOW_GHOSTS[0] + WINDOW_GHOSTS[1]) * n, ghost_mult),
          p_(kind == Kind::WINDOW ? start * static_cast<double>(n) : 0.0),
          low_(low * static_cast<double>(n)), high_(high * static_cast<double>(n)) {}

    Kind kind() const { return kind_; }
    i64 size() const { return lists_.size(T1) + lists_.size(T2); }
    bool tracked(i64 s) const { u8 l = lists_.lid(s); return l == T1 || l == T2; }
    double p() const { return p_; }
    const Ghosts& ghosts() const { return ghosts_; }
    size_t nbytes() const { return ghosts_.nbytes(); }  // the lists are the tier's

    void insert(const i64* s, i64 m) {
        for (i64 i = 0; i < m; ++i)
            if (lists_.lid(s[i]) != NO_LIST)
                fail(Err::Slot, "slot " + S(s[i]) + " is already tracked by the " + kind_name(kind_) + " policy");
        if (m > 1) {
            std::vector<i64> sorted(s, s + m);
            std::sort(sorted.begin(), sorted.end());
            auto rep = std::adjacent_find(sorted.begin(), sorted.end());
            if (rep != sorted.end()) fail(Err::Slot, "slot " + S(*rep) + " appears twice in one insert batch");
        }
        if (kind_ == Kind::LRU) {
            for (i64 i = 0; i < m; ++i) lists_.push_back(T1, s[i]);
            return;
        }
        // A tag repeated in the batch: the first slot takes the ghost (discarded at once), the rest are new.
        std::vector<u8> to_t2(static_cast<size_t>(m), 0);
        i64 in_window = 0, in_main = 0;
        for (i64 i = 0; i < m; ++i) {
            i32 g = ghosts_.find(tags_[s[i]]);
            if (g < 0 && history_) {
                i32 h = history_->find(tags_[s[i]]);
                if (h >= 0) {
                    to_t2[static_cast<size_t>(i)] = history_->list_of(h) == 1;
                    history_->discard(h);
                }
            }
            if (g < 0) continue;
            int l = ghosts_.list_of(g);
            if (kind_ == Kind::ARC) {
                double g1 = static_cast<double>(ghosts_.size(0)), g2 = static_cast<double>(ghosts_.size(1));
                if (l == 0) p_ = std::min(static_cast<double>(n_), p_ + std::max(1.0, g2 / g1));
                else p_ = std::max(0.0, p_ - std::max(1.0, g1 / g2));
            } else {
                (l == 0 ? in_window : in_main) += 1;
            }
            ghosts_.discard(g);
            to_t2[static_cast<size_t>(i)] = 1;
        }
        if (kind_ == Kind::WINDOW)
            p_ = std::min(high_, std::max(low_, p_ + static_cast<double>(in_window - in_main)));
        for (i64 i = 0; i < m; ++i) lists_.push_back(to_t2[static_cast<size_t>(i)] ? T2 : T1, s[i]);
    }

    void touch(const i64* s, i64 m) {
        u8 to = kind_ == Kind::LRU ? T1 : T2;
        for (i64 i = 0; i < m; ++i)
            if (tracked(s[i])) lists_.move_back(to, s[i]);
    }

    void remove(const i64* s, i64 m) {
        for (i64 i = 0; i < m; ++i)
            if (tracked(s[i])) lists_.unlink(s[i]);
    }

    // Slots whose block moved up to a faster tier on a hit: the window remembers them as main's ghosts.
    void demote(const i64* s, i64 m) {
        if (kind_ != Kind::WINDOW) return remove(s, m);
        for (i64 i = 0; i < m; ++i) {
            if (!tracked(s[i])) continue;
            lists_.unlink(s[i]);
            add_ghost(tags_[s[i]], 1);
        }
    }

    // Exactly n unpinned victims in eviction order, out of the lists (their ghosts added); or none.
    template <class Pins>
    bool evict(i64 n, const Pins& pins, std::vector<i64>& out) {
        out.clear();
        if (n <= 0 || n > size()) return n == 0;
        if (!select(lists_, n, pins, out, from_)) {
            out.clear();
            return false;
        }
        for (size_t i = 0; i < out.size(); ++i) {
            lists_.unlink(out[i]);
            if (kind_ != Kind::LRU) add_ghost(tags_[out[i]], from_[i] == T1 ? 0 : 1);
        }
        return true;
    }

    // The full eviction order, first = next victim, pins ignored (tests and debugging).
    std::vector<i64> order() const {
        std::vector<i64> out;
        std::vector<u8> from;
        if (size()) select(lists_, size(), PinView{}, out, from);
        return out;
    }

    // The next victim among the members of `sub`, lists that mirror the policy's for one tier's
    // blocks in the same order (ARC's rule with the whole policy's p and |T1|); -1 if none.
    template <class Pins>
    i64 next_in(const Lists& sub, const Pins& pins) const {
        // select() for one victim, without its buffers: T1 first while |T1| exceeds p, then T2, then T1.
        i64 t1 = sub.first_unpinned(T1, pins);
        if (kind_ == Kind::LRU) return t1;
        if (t1 >= 0 && std::ceil(static_cast<double>(lists_.size(T1)) - p_) >= 1.0) return t1;
        i64 t2 = sub.first_unpinned(T2, pins);
        return t2 >= 0 ? t2 : t1;
    }

    // Node p leaves the hierarchy as an eviction would take it (its ghost added).
    void evict_node(i64 p) {
        u8 l = lists_.lid(p);
        lists_.unlink(p);
        if (kind_ != Kind::LRU) add_ghost(tags_[p], l == T1 ? 0 : 1);
    }

private:
    // ARC's REPLACE one victim at a time takes from T1 while |T1| (shrinking) exceeds p, then from
    // T2, then from T1 again once T2 runs out: T1's first a, T2's candidates, T1's remaining ones.
    template <class Pins>
    bool select(const Lists& L, i64 n, const Pins& pins, std::vector<i64>& out, std::vector<u8>& from) const {
        out.clear();
        from.clear();
        if (kind_ == Kind::LRU) {
            L.candidates(T1, n, pins, out);
            from.assign(out.size(), T1);
            return static_cast<i64>(out.size()) == n;
        }
        double over = std::ceil(static_cast<double>(lists_.size(T1)) - p_);
        i64 first = std::min<i64>(n, std::max<i64>(0, static_cast<i64>(over)));
        L.candidates(T1, first, pins, c1_);
        i64 a = static_cast<i64>(c1_.size());
        L.candidates(T2, n - a, pins, c2_);
        i64 j2 = static_cast<i64>(c2_.size());
        if (a + j2 < n) {
            L.candidates(T1, n - j2, pins, c1_);
            if (static_cast<i64>(c1_.size()) < n - j2) return false;
        }
        i64 j1 = n - j2;
        out.insert(out.end(), c1_.begin(), c1_.begin() + a);
        out.insert(out.end(), c2_.begin(), c2_.begin() + j2);
        out.insert(out.end(), c1_.begin() + a, c1_.begin() + j1);
        from.assign(static_cast<size_t>(a), T1);
        from.insert(from.end(), static_cast<size_t>(j2), T2);
        from.insert(from.end(), static_cast<size_t>(j1 - a), T1);
        return true;
    }

    // Add a tag at the newest end of ghost list l (an existing ghost of the tag moves there).
    // ARC: both lists share a bound of n; when full, the longer list's oldest goes (the other one's
    // on a tie with the list just added to). Window: each list drops its own oldest over its bound.
    void add_ghost(u64 tag, int l) {
        i32 g = ghosts_.find(tag);
        if (g >= 0) ghosts_.discard(g);
        i64 b0 = ghosts_.size(0), b1 = ghosts_.size(1);
        if (kind_ == Kind::ARC) {
            if (ghosts_.capacity() == 0) return;
            if (b0 + b1 >= ghosts_.capacity()) {
                i64 d = b0 - b1;
                ghosts_.pop_oldest(l == 0 ? (d >= 0 ? 0 : 1) : (d <= 0 ? 1 : 0));
            }
        } else {
            i64 bound = WINDOW_GHOSTS[l] * n_;
            if (bound == 0) return;
            if (ghosts_.size(l) >= bound) ghosts_.pop_oldest(l);
        }
        ghosts_.push(l, tag);
    }

    Kind kind_;
    i64 n_;
    Lists& lists_;
    const u64* tags_;
    Ghosts* history_;
    Ghosts ghosts_;
    double p_, low_, high_;
    mutable std::vector<i64> c1_, c2_;
    std::vector<u8> from_;
};

}  // namespace tkv
