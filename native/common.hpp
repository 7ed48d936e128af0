// Shared types and the error the core raises: its kind picks the Python exception (bind.cpp).
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace tkv {

using i64 = int64_t;
using i32 = int32_t;
using u8 = uint8_t;
using u16 = uint16_t;
using u64 = uint64_t;

enum class Err { Tier, Key, Slot, Transfer, BlockId };

// The most slots one tier, key table or policy may have: positions and links are int32, and the
// largest int32 arrays are the window policy's ghost pool (6 nodes per slot, plus 2 sentinels) and a
// key table's entries (2 per slot). config.MAX_SLOTS reads this number.
constexpr i64 MAX_SLOTS = ((i64(1) << 31) - 1 - 2) / 6;

struct CoreError : std::runtime_error {
    Err kind;
    CoreError(Err k, const std::string& msg) : std::runtime_error(msg), kind(k) {}
};

[[noreturn]] inline void fail(Err kind, const std::string& msg) { throw CoreError(kind, msg); }

inline std::string S(i64 v) { return std::to_string(v); }

// 64x64 -> 128-bit multiply, folded: the mixing step of the keyed hashes below.
inline u64 mum(u64 a, u64 b) {
    __uint128_t r = static_cast<__uint128_t>(a) * b;
    return static_cast<u64>(r) ^ static_cast<u64>(r >> 64);
}

// An index in [0, size) from the high 32 bits of a hash (multiply-shift: size need not be a power of two).
inline size_t scale(u64 h, u64 size) { return static_cast<size_t>(((h >> 32) * size) >> 32); }

// A fixed-size array whose storage Python's read-only views share (share()): a view keeps the bytes
// alive, not the object that owns them, so a Python owner that stores its own views (TierIndex.state)
// makes no reference cycle through a numpy array (which the GC cannot traverse), and a view kept after
// its owner is freed reads valid, if stale, memory.
template <class T>
class SharedArray {
public:
    SharedArray(size_t n, T fill) : p_(new T[n]), n_(n) { std::fill_n(p_.get(), n, fill); }
    T& operator[](i64 i) { return p_.get()[i]; }
    const T& operator[](i64 i) const { return p_.get()[i]; }
    T* data() { return p_.get(); }
    const T* data() const { return p_.get(); }
    size_t size() const { return n_; }
    std::shared_ptr<const void> share() const { return p_; }

private:
    std::shared_ptr<T[]> p_;
    size_t n_;
};

// Which slots a caller holds: a read-only view of a pin-count array of any integer width.
struct PinView {
    const u8* base = nullptr;
    int itemsize = 0;
    bool pinned(i64 s) const {
        if (!base) return false;
        const u8* p = base + s * itemsize;
        switch (itemsize) {
            case 1: return *p != 0;
            case 2: { u16 v; std::memcpy(&v, p, 2); return v != 0; }
            case 4: { uint32_t v; std::memcpy(&v, p, 4); return v != 0; }
            default: { u64 v; std::memcpy(&v, p, 8); return v != 0; }
        }
    }
};

}  // namespace tkv
