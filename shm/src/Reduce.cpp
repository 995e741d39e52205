// The reduction kernels: fp32 accumulators over blocks, one version per x86 level the CPU has.
#include "dcplan/shm/ShmComm.h"

#include <bit>
#include <cstring>

namespace dcplan::shm {
namespace {

// Loads and stores of one element type as fp32. The conversions match c10's (round to
// nearest even, NaN kept quiet), so a sum here equals torch's sum of the same fp32 values cast.
struct F32 {
  using T = float;
  static float load(T x) { return x; }
  static T store(float f) { return f; }
};

struct BF16 {
  using T = uint16_t;
  static float load(T x) { return std::bit_cast<float>(static_cast<uint32_t>(x) << 16); }
  static T store(float f) {
    uint32_t u = std::bit_cast<uint32_t>(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<T>((u >> 16) | 0x40u);
    u += 0x7fffu + ((u >> 16) & 1u);
    return static_cast<T>(u >> 16);
  }
};

struct F16 {
  using T = _Float16;
  static float load(T x) { return static_cast<float>(x); }
  static T store(float f) { return static_cast<T>(f); }
};

// Blocks of fp32 accumulators on the stack: the loops vectorise, and out may alias an input
// (each block is read whole before it is written).
constexpr size_t kBlock = 512;

template <typename E>
inline __attribute__((always_inline)) void sumBlocks(void* outV, const void* const* insV, int nIns,
                                                     size_t count) {
  using T = typename E::T;
  T* out = static_cast<T*>(outV);
  for (size_t base = 0; base < count; base += kBlock) {
    const size_t n = count - base < kBlock ? count - base : kBlock;
    float acc[kBlock];
    const T* in0 = static_cast<const T*>(insV[0]) + base;
    for (size_t i = 0; i < n; ++i) acc[i] = E::load(in0[i]);
    for (int k = 1; k < nIns; ++k) {
      const T* in = static_cast<const T*>(insV[k]) + base;
      for (size_t i = 0; i < n; ++i) acc[i] += E::load(in[i]);
    }
    for (size_t i = 0; i < n; ++i) out[base + i] = E::store(acc[i]);
  }
}

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__)
#define DCPLAN_KERNEL __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define DCPLAN_KERNEL
#endif

DCPLAN_KERNEL void sumF32(void* out, const void* const* ins, int nIns, size_t count) {
  sumBlocks<F32>(out, ins, nIns, count);
}
DCPLAN_KERNEL void sumBF16(void* out, const void* const* ins, int nIns, size_t count) {
  sumBlocks<BF16>(out, ins, nIns, count);
}
DCPLAN_KERNEL void sumF16(void* out, const void* const* ins, int nIns, size_t count) {
  sumBlocks<F16>(out, ins, nIns, count);
}

}  // namespace

void reduceSum(DType dtype, void* out, const void* const* ins, int nIns, size_t count) {
  switch (dtype) {
    case DType::Float32:
      return sumF32(out, ins, nIns, count);
    case DType::BFloat16:
      return sumBF16(out, ins, nIns, count);
    case DType::Float16:
      return sumF16(out, ins, nIns, count);
  }
  throw Error("reduceSum: unknown dtype code " + std::to_string(static_cast<uint32_t>(dtype)));
}

size_t elementSize(DType dtype) {
  switch (dtype) {
    case DType::Float32:
      return 4;
    case DType::BFloat16:
    case DType::Float16:
      return 2;
  }
  throw Error("elementSize: unknown dtype code " + std::to_string(static_cast<uint32_t>(dtype)));
}

const char* dtypeName(DType dtype) {
  switch (dtype) {
    case DType::Float32:
      return "float32";
    case DType::BFloat16:
      return "bfloat16";
    case DType::Float16:
      return "float16";
  }
  return "unknown";
}

}  // namespace dcplan::shm
