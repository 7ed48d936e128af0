// Host row copies between two sets of regions (the engine's block tensors and the CPU slab's
// region views): row src[i] of every region of one side into row dst[i] of the other. Runs that are
// consecutive on both sides are one memcpy per region when rows are dense. Pure C++ (the binding
// releases the GIL around it): single-threaded, so it never wakes a thread pool.
#pragma once
#include <algorithm>

#include "common.hpp"

namespace tkv {

struct Region {
    u8* base;
    i64 rows, stride, width;  // stride and width in bytes
};

inline void copy_rows(const std::vector<Region>& from, const std::vector<Region>& to, const i64* src,
                      const i64* dst, i64 n) {
    if (n <= 0) return;  // an empty batch may come with null id pointers
    // Runs consecutive on both sides first, then region by region (as a per-region gather does:
    // measured faster than row by row across the regions for scattered destination rows).
    std::vector<i64> cuts{0};
    for (i64 i = 1; i < n; ++i)
        if (src[i] != src[i - 1] + 1 || dst[i] != dst[i - 1] + 1) cuts.push_back(i);
    cuts.push_back(n);
    for (size_t r = 0; r < from.size(); ++r) {
        const Region &f = from[r], &t = to[r];
        const bool dense = f.stride == f.width && t.stride == t.width;
        for (size_t c = 0; c + 1 < cuts.size(); ++c) {
            const i64 a = cuts[c], b = cuts[c + 1];
            const u8* s = f.base + src[a] * f.stride;
            u8* d = t.base + dst[a] * t.stride;
            if (dense) {
                std::memcpy(d, s, static_cast<size_t>((b - a) * f.width));
            } else {
                for (i64 i = 0; i < b - a; ++i) std::memcpy(d + i * t.stride, s + i * f.stride, static_cast<size_t>(f.width));
            }
        }
    }
}

// Which id of a batch of n repeats (sorting a copy), or -1.
inline i64 repeated_id(const i64* ids, i64 n) {
    if (n < 2) return -1;
    std::vector<i64> s(ids, ids + n);
    std::sort(s.begin(), s.end());
    auto rep = std::adjacent_find(s.begin(), s.end());
    return rep == s.end() ? -1 : *rep;
}

// How many runs of consecutive ids n distinct ids (any order) form: 0 for none (the store metrics' count,
// one sort of a small copy instead of numpy's four passes).
inline i64 count_runs(const i64* ids, i64 n) {
    if (n < 1) return 0;
    std::vector<i64> s(ids, ids + n);
    std::sort(s.begin(), s.end());
    i64 runs = 1;
    for (i64 i = 1; i < n; ++i) runs += s[static_cast<size_t>(i)] != s[static_cast<size_t>(i - 1)] + 1;
    return runs;
}

}  // namespace tkv
