// The head sizes the paged-attention kernels are compiled for: every one real checkpoints use.
// This is the one list: the CPU and CUDA dispatch expand it, the argument checks test against
// it, and cuda_ext.ops.HEAD_SIZES reads it for the engine's load-time check. Plain C++, so nvcc
// and the host compiler both include it.
#pragma once

#define PAGEDSERVE_HEAD_SIZES(X) X(32) X(40) X(48) X(64) X(80) X(96) X(112) X(128) X(160) X(192) X(256)

namespace pagedserve {

constexpr bool supported_head_size(long long d) {
#define PAGEDSERVE_IS(D) d == D ||
  return PAGEDSERVE_HEAD_SIZES(PAGEDSERVE_IS) false;
#undef PAGEDSERVE_IS
}

#define PAGEDSERVE_TEXT(D) " " #D
constexpr const char* kHeadSizesText = PAGEDSERVE_HEAD_SIZES(PAGEDSERVE_TEXT);  // " 32 40 ... 256"
#undef PAGEDSERVE_TEXT

}  // namespace pagedserve
