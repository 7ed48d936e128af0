// One call's descriptors onto a stream: ONE cuMemcpyBatchAsync (every copy ordered with the stream, the copy
// engines preferred over SM copies), or cuMemcpyAsync per descriptor on drivers < 12.8. "" or what failed.
#pragma once
#include "copy_plan.hpp"
#include "cuda_driver.hpp"

namespace tkv {

inline std::string submit_batch(const cu::Driver& d, Descriptors& desc, cu::CUstream stream) {
    const size_t count = desc.size();
    if (count == 0) return "";
    if (d.has_batch()) {
        cu::MemcpyAttributes attr{};
        attr.srcAccessOrder = cu::SRC_ACCESS_ORDER_STREAM;
        attr.flags = cu::MEMCPY_FLAG_PREFER_OVERLAP_WITH_COMPUTE;
        size_t first = 0, fail_idx = SIZE_MAX;
        auto* dst = reinterpret_cast<cu::CUdeviceptr*>(desc.dst.data());
        auto* src = reinterpret_cast<cu::CUdeviceptr*>(desc.src.data());
        cu::CUresult rc = d.batch13 ? d.batch13(dst, src, desc.bytes.data(), count, &attr, &first, 1, stream)
                                     : d.batch12(dst, src, desc.bytes.data(), count, &attr, &first, 1, &fail_idx, stream);
        if (rc == cu::SUCCESS) return "";
        return "cuMemcpyBatchAsync of " + S(static_cast<i64>(count)) + " copies failed with CUresult " + S(rc) +
               (fail_idx != SIZE_MAX ? " at copy " + S(static_cast<i64>(fail_idx)) : "");
    }
    for (size_t i = 0; i < count; ++i) {
        cu::CUresult rc = d.memcpy_async(desc.dst[i], desc.src[i], desc.bytes[i], stream);
        if (rc != cu::SUCCESS)
            return "cuMemcpyAsync " + S(static_cast<i64>(i)) + " of " + S(static_cast<i64>(count)) + " failed with CUresult " + S(rc);
    }
    return "";
}

}  // namespace tkv
