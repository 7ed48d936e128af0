// A standalone policy over its own lists (the flat simulators use one): tags are given on insert.
#pragma once
#include "policy.hpp"

namespace tkv {

struct PolicyCore {
    i64 n;
    Lists lists;
    std::vector<u64> tags;
    Policy policy;  // refers to the two members above: a copy or a move would dangle
    PolicyCore(Kind kind, i64 n_, u64 mult, double start, double low, double high)
        : n(n_), lists(n_), tags(static_cast<size_t>(n_), 0), policy(kind, n_, lists, tags.data(), mult, start, low, high) {}
    PolicyCore(const PolicyCore&) = delete;
    PolicyCore& operator=(const PolicyCore&) = delete;
};

}  // namespace tkv
