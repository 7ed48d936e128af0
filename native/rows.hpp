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
    i64 a = 0;
    while (a < n) {
        i64 b = a + 1;
        while (b < n && src[b] == src[b - 1] + 1 && dst[b] == dst[b - 1] + 1) ++b;
        for (size_t r = 0; r < from.size(); ++r) {
            const Region &f = from[r], &t = to[r];
            const u8* s = f.base + src[a] * f.stride;
            u8* d = t.base + dst[a] * t.stride;
            if (f.stride == f.width && t.stride == t.width) {
                std::memcpy(d, s, static_cast<size_t>((b - a) * f.width));
            } else {
                for (i64 i = 0; i < b - a; ++i) std::memcpy(d + i * t.stride, s + i * f.stride, static_cast<size_t>(f.width));
            }
        }
        a = b;
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

}  // namespace tkv
