// A sum all-reduce among the processes of one machine through one shared-memory segment (no torch).
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace dcplan::shm {

/// Element types the reduction kernels handle. Sums accumulate in fp32 in rank order, so every
/// rank gets the same bits, and repeated runs too.
enum class DType : uint32_t { Float32 = 1, BFloat16 = 2, Float16 = 3 };
size_t elementSize(DType dtype);
const char* dtypeName(DType dtype);

/// What every error of this library throws; the message names the operation and what was expected.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

struct Options {
  /// The directory segments live in: a tmpfs shared by the ranks (DCPLAN_SHM_DIR).
  std::string dir = "/dev/shm";
  /// How long a rank waits for the others at one synchronisation point before it gives up.
  std::chrono::milliseconds timeout{300'000};
  /// Bytes of each rank's buffer (two per rank): a message is reduced in chunks of this size.
  size_t slotBytes = 1 << 20;
  /// Chunks up to this size are reduced by every rank (one synchronisation); larger ones by
  /// slices, one per rank, then copied out (two synchronisations, 2x less data read per rank).
  size_t wholeChunkBytes = 16 << 10;
};

/// Identifies the shared memory a process sees: the kernel boot, the device and inode of dir.
/// Processes with equal keys reach the same segments. Throws Error when dir is not a directory.
std::string localKey(const std::string& dir);

/// A segment name unique to this job: "dcplan-<pid>-<random>".
std::string uniqueSegmentName();

class Segment;

/// One rank's view of a shared segment of worldSize ranks. Collective: every rank calls
/// allReduce with the same element count and dtype, in the same order. After an error (a
/// timeout, a rank that died, ranks that disagree) the communicator refuses every later call,
/// and the other ranks leave their current wait promptly with the reason.
class ShmComm {
 public:
  /// Rank 0: makes a segment file `name` in options.dir, with its memory reserved (a full
  /// tmpfs fails here with ENOSPC, not later with SIGBUS). The other ranks open() it next, then
  /// rank 0 calls unlinkName(): the memory stays until the last rank unmaps it, so nothing is
  /// left in the directory, even when a process is killed.
  static std::unique_ptr<ShmComm> create(const std::string& name, int worldSize, const Options& options);
  /// Ranks 1..worldSize-1: maps the segment rank 0 created.
  static std::unique_ptr<ShmComm> open(const std::string& name, int rank, int worldSize,
                                       const Options& options);
  ~ShmComm();
  ShmComm(const ShmComm&) = delete;
  ShmComm& operator=(const ShmComm&) = delete;

  /// Removes the segment's name from the directory (rank 0, once every rank has opened it).
  void unlinkName();

  /// In-place sum all-reduce of count contiguous elements at data. `op` names the caller's
  /// operation in error messages.
  void allReduce(const char* op, void* data, size_t count, DType dtype);

  int rank() const { return rank_; }
  int worldSize() const { return worldSize_; }
  const std::string& path() const;
  /// Whether an earlier error made this communicator unusable.
  bool broken() const { return !brokenReason_.empty(); }

 private:
  ShmComm(std::unique_ptr<Segment> segment, int rank, int worldSize, const Options& options);
  void reduceChunk(const char* op, char* data, size_t count, size_t total, DType dtype);
  /// Marks this rank at the next synchronisation point and waits for every rank to reach it.
  void sync(const char* op);
  void waitForAll(const char* op, uint32_t point);
  /// Throws when another rank failed (its reason is in the segment).
  void checkAbort(const char* op);
  [[noreturn]] void fail(const std::string& message, bool tellOthers);

  std::unique_ptr<Segment> segment_;
  int rank_;
  int worldSize_;
  Options options_;
  uint32_t syncs_ = 0;   // synchronisation points passed
  uint64_t chunks_ = 0;  // chunks reduced: chunk k uses buffer k % 2
  std::string brokenReason_;
  std::vector<const void*> inputs_;  // per chunk: every rank's buffer (or slice), reused
};

/// out[i] = sum over k of ins[k][i] in k order, accumulated in fp32 and rounded once to dtype.
/// out may be one of ins (same address); nothing else may overlap.
void reduceSum(DType dtype, void* out, const void* const* ins, int nIns, size_t count);

}  // namespace dcplan::shm
