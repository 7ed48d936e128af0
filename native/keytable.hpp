// KeyTable: fixed-length bytes key -> slot id in 0..num_slots-1, each slot holding at most one key.
//
// Open addressing with linear probing over int32 entries (2 per slot, so half full at most) and
// backward-shift deletion: no tombstones, so the table never degrades under churn. Each slot keeps
// its key's bytes, its 64-bit hash (compared before the bytes, and the policies' ghost tag) and the
// entry that points at it. The hash is keyed by per-table secrets (from os.urandom) and reads every
// byte of the key, so crafted keys cannot be aimed at one probe run.
#pragma once
#include "common.hpp"

namespace tkv {

class KeyTable {
public:
    KeyTable(const KeyTable&) = delete;
    KeyTable& operator=(const KeyTable&) = delete;
    KeyTable(i64 num_slots, int key_bytes, u64 s0, u64 s1, u64 s2)
        : n_(num_slots), kb_(key_bytes), s0_(s0), s1_(s1 | 1), s2_(s2 | 1),
          keys_(static_cast<size_t>(num_slots) * key_bytes, 0), hash_(num_slots, 0), pos_(num_slots, -1),
          tsize_(static_cast<u64>(std::max<i64>(8, 2 * num_slots))), table_(tsize_, -1) {}

    i64 num_slots() const { return n_; }
    int key_bytes() const { return kb_; }
    i64 size() const { return count_; }
    u8* keys_data() { return keys_.data(); }
    std::shared_ptr<const void> share_keys() const { return keys_.share(); }
    const u8* key_at(i64 slot) const { return keys_.data() + slot * kb_; }
    u64 hash_at(i64 slot) const { return hash_[slot]; }
    const u64* hashes() const { return hash_.data(); }
    bool held(i64 slot) const { return pos_[slot] >= 0; }
    size_t nbytes() const {
        return keys_.size() + hash_.size() * sizeof(u64) + pos_.size() * sizeof(i32) + table_.size() * sizeof(i32);
    }

    u64 hash(const u8* k) const {
        u64 h = s0_ ^ static_cast<u64>(kb_);
        int i = 0;
        for (; i + 8 <= kb_; i += 8) {
            u64 w;
            std::memcpy(&w, k + i, 8);
            h = mum(h ^ w, s1_ + static_cast<u64>(i));
        }
        if (i < kb_) {
            u64 w = 0;
            std::memcpy(&w, k + i, static_cast<size_t>(kb_ - i));
            h = mum(h ^ w, s1_ + static_cast<u64>(i));
        }
        return mum(h, s2_);
    }

    i64 find(const u8* k) const { return find_h(k, hash(k)); }

    i64 find_h(const u8* k, u64 h) const {
        size_t i = scale(h, tsize_);
        for (;;) {
            i32 s = table_[i];
            if (s < 0) return -1;
            if (hash_[s] == h && std::memcmp(keys_.data() + static_cast<size_t>(s) * kb_, k, kb_) == 0) return s;
            if (++i == tsize_) i = 0;
        }
    }

    // The slot must be empty and the key absent (callers check both first).
    void insert_h(const u8* k, u64 h, i64 slot) {
        if (slot < 0 || slot >= n_ || pos_[slot] >= 0) fail(Err::Tier, "KeyTable: slot " + S(slot) + " is not empty");
        std::memcpy(keys_.data() + slot * kb_, k, kb_);
        hash_[slot] = h;
        size_t i = scale(h, tsize_);
        while (table_[i] >= 0)
            if (++i == tsize_) i = 0;
        table_[i] = static_cast<i32>(slot);
        pos_[slot] = static_cast<i32>(i);
        ++count_;
    }

    // The slot must hold a key (checked: a caller's state may disagree). Later entries of the probe
    // run move back into the hole.
    void remove(i64 slot) {
        if (slot < 0 || slot >= n_ || pos_[slot] < 0) fail(Err::Tier, "KeyTable: slot " + S(slot) + " holds no key to remove");
        size_t i = static_cast<size_t>(pos_[slot]);
        pos_[slot] = -1;
        table_[i] = -1;
        --count_;
        size_t j = i;
        for (;;) {
            if (++j == tsize_) j = 0;
            i32 s = table_[j];
            if (s < 0) return;
            size_t home = scale(hash_[s], tsize_);
            // The entry may move to the hole at i unless its home lies cyclically in (i, j].
            bool stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
            if (!stays) {
                table_[i] = s;
                pos_[s] = static_cast<i32>(i);
                table_[j] = -1;
                i = j;
            }
        }
    }

    // Raises unless every held slot is found at its entry, every entry is a held slot's, and the count adds up.
    void check() const {
        i64 held_n = 0, entries = 0;
        for (i64 s = 0; s < n_; ++s) {
            if (pos_[s] < 0) continue;
            ++held_n;
            if (table_[static_cast<size_t>(pos_[s])] != s) fail(Err::Tier, "KeyTable slot " + S(s) + ": its entry and its position disagree");
            if (hash(key_at(s)) != hash_[s]) fail(Err::Tier, "KeyTable slot " + S(s) + ": its hash is not its key's");
            if (find(key_at(s)) != s) fail(Err::Tier, "KeyTable slot " + S(s) + ": its key is not found at it");
        }
        for (size_t i = 0; i < tsize_; ++i)
            if (table_[i] >= 0) {
                ++entries;
                if (pos_[table_[i]] != static_cast<i32>(i)) fail(Err::Tier, "KeyTable entry " + S(static_cast<i64>(i)) + " points at a slot that is elsewhere");
            }
        if (held_n != count_ || entries != count_)
            fail(Err::Tier, "KeyTable counts disagree: " + S(entries) + " entries, " + S(held_n) + " slots held, len " + S(count_));
    }

    std::string hex(const u8* k) const {
        static const char* d = "0123456789abcdef";
        std::string out;
        for (int i = 0; i < kb_; ++i) {
            out += d[k[i] >> 4];
            out += d[k[i] & 15];
        }
        return out;
    }

private:
    i64 n_;
    int kb_;
    u64 s0_, s1_, s2_;
    SharedArray<u8> keys_;  // the keys view shares it
    std::vector<u64> hash_;
    std::vector<i32> pos_;
    u64 tsize_;
    std::vector<i32> table_;
    i64 count_ = 0;
};

}  // namespace tkv
