// The shared segment, its layout, the synchronisation protocol and the chunked all-reduce.
#include "dcplan/shm/ShmComm.h"

#include <atomic>
#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include <fcntl.h>
#include <linux/futex.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace dcplan::shm {
namespace {

constexpr uint64_t kMagic = 0x64637368'6d763031ull;  // "dcshmv01"
constexpr uint32_t kVersion = 1;
constexpr size_t kPage = 4096;
constexpr size_t kReasonBytes = 1024;

// Waiting: a short spin (ranks usually arrive within microseconds of each other), a few
// yields (another rank may need this core), then futex sleeps, so that more ranks than cores
// do not starve each other. Sleeps are short, to notice an abort, a dead rank or the timeout.
constexpr int kSpins = 2000;
constexpr int kYields = 64;
constexpr auto kSleep = std::chrono::milliseconds(20);
constexpr auto kLivenessPeriod = std::chrono::milliseconds(100);

struct Header {
  uint64_t magic;
  uint32_t version;
  uint32_t worldSize;
  uint64_t slotBytes;
  uint64_t totalBytes;
  std::atomic<int32_t> abortRank;  // -1: none; -2: a rank is writing its reason
  char abortReason[kReasonBytes];
};
static_assert(sizeof(Header) <= kPage);
static_assert(std::atomic<uint32_t>::is_always_lock_free && std::atomic<int32_t>::is_always_lock_free,
              "the segment's atomics must be address-free");

struct alignas(64) RankControl {
  std::atomic<uint32_t> arrived;  // synchronisation points this rank has reached (a futex word)
  std::atomic<uint32_t> waiters;  // ranks sleeping on `arrived`: the rank wakes them
  int32_t pid;
  uint64_t pidNamespace;
};

// What a rank reduces in a buffer: the others check it against their own.
struct alignas(64) SlotHeader {
  uint64_t chunk;
  uint64_t total;
  uint64_t count;
  uint32_t dtype;
};

size_t roundUp(size_t n, size_t to) { return (n + to - 1) / to * to; }

size_t slotStride(size_t slotBytes) { return roundUp(sizeof(SlotHeader) + slotBytes, kPage); }
size_t slotsOffset(int worldSize) { return roundUp(kPage + worldSize * sizeof(RankControl), kPage); }
size_t segmentBytes(int worldSize, size_t slotBytes) {
  return slotsOffset(worldSize) + 2 * static_cast<size_t>(worldSize) * slotStride(slotBytes);
}

std::string errnoText(int err) {
  return std::string(std::strerror(err)) + " (errno " + std::to_string(err) + ")";
}

uint64_t pidNamespace() {
  struct stat st {};
  return ::stat("/proc/self/ns/pid", &st) == 0 ? st.st_ino : 0;
}

int futex(std::atomic<uint32_t>* word, int op, uint32_t value, const timespec* timeout) {
  // Not FUTEX_PRIVATE: the word is in memory shared between processes.
  return static_cast<int>(
      ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(word), op, value, timeout, nullptr, 0));
}

void cpuRelax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

/// Whether process pid has ended: gone, or a zombie its parent has not reaped yet.
bool exited(int32_t pid) {
  if (::kill(pid, 0) != 0) return errno == ESRCH;
  std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
  std::string line;
  if (!std::getline(stat, line)) return false;
  const size_t close = line.rfind(')');  // the command name may hold spaces and parentheses
  return close != std::string::npos && close + 2 < line.size() &&
         (line[close + 2] == 'Z' || line[close + 2] == 'X');
}

bool reached(const std::atomic<uint32_t>& arrived, uint32_t point) {
  return static_cast<int32_t>(arrived.load(std::memory_order_acquire) - point) >= 0;
}

}  // namespace

/// A mapped segment file: the descriptor, the mapping, and the path it was made at.
class Segment {
 public:
  Segment(std::string path, int fd, void* base, size_t bytes)
      : path_(std::move(path)), fd_(fd), base_(static_cast<char*>(base)), bytes_(bytes) {}
  ~Segment() {
    ::munmap(base_, bytes_);
    ::close(fd_);
  }
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  const std::string& path() const { return path_; }
  Header& header() { return *reinterpret_cast<Header*>(base_); }
  RankControl& control(int rank) { return reinterpret_cast<RankControl*>(base_ + kPage)[rank]; }
  SlotHeader& slotHeader(int rank, int buffer) { return *reinterpret_cast<SlotHeader*>(slot(rank, buffer)); }
  char* slotData(int rank, int buffer) { return slot(rank, buffer) + sizeof(SlotHeader); }

 private:
  char* slot(int rank, int buffer) {
    const Header& h = header();
    return base_ + slotsOffset(h.worldSize) +
           (2 * static_cast<size_t>(rank) + buffer) * slotStride(h.slotBytes);
  }

  std::string path_;
  int fd_;
  char* base_;
  size_t bytes_;
};

std::string localKey(const std::string& dir) {
  struct stat st {};
  if (::stat(dir.c_str(), &st) != 0) throw Error("shared-memory directory " + dir + ": " + errnoText(errno));
  if (!S_ISDIR(st.st_mode)) throw Error("shared-memory directory " + dir + ": not a directory");
  std::string boot;
  std::ifstream in("/proc/sys/kernel/random/boot_id");
  if (!(in >> boot)) {
    char host[256] = {};
    ::gethostname(host, sizeof host - 1);
    boot = host;
  }
  return boot + ":" + std::to_string(st.st_dev) + ":" + std::to_string(st.st_ino);
}

std::string uniqueSegmentName() {
  std::random_device rd;
  std::ostringstream name;
  name << "dcplan-" << ::getpid() << "-" << std::hex << ((static_cast<uint64_t>(rd()) << 32) | rd());
  return name.str();
}

std::unique_ptr<ShmComm> ShmComm::create(const std::string& name, int worldSize, const Options& options) {
  if (worldSize < 1)
    throw Error("ShmComm::create: worldSize should be at least 1, got " + std::to_string(worldSize));
  const std::string path = options.dir + "/" + name;
  const size_t bytes = segmentBytes(worldSize, options.slotBytes);
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0) throw Error("cannot create shared-memory segment " + path + ": " + errnoText(errno));
  // Reserve the pages now: on a full tmpfs a plain ftruncate would succeed and a later write
  // would die of SIGBUS.
  if (int err = ::posix_fallocate(fd, 0, static_cast<off_t>(bytes)); err != 0) {
    ::close(fd);
    ::unlink(path.c_str());
    throw Error("cannot reserve " + std::to_string(bytes) + " bytes for shared-memory segment " + path +
                ": " + errnoText(err));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    ::unlink(path.c_str());
    throw Error("cannot map shared-memory segment " + path + ": " + errnoText(err));
  }
  auto segment = std::make_unique<Segment>(path, fd, base, bytes);
  Header& h = segment->header();
  h.version = kVersion;
  h.worldSize = static_cast<uint32_t>(worldSize);
  h.slotBytes = options.slotBytes;
  h.totalBytes = bytes;
  h.abortRank.store(-1);
  h.magic = kMagic;
  return std::unique_ptr<ShmComm>(new ShmComm(std::move(segment), 0, worldSize, options));
}

std::unique_ptr<ShmComm> ShmComm::open(const std::string& name, int rank, int worldSize,
                                       const Options& options) {
  if (rank < 1 || rank >= worldSize)
    throw Error("ShmComm::open: rank should be in [1, " + std::to_string(worldSize) + "), got " +
                std::to_string(rank));
  const std::string path = options.dir + "/" + name;
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) throw Error("cannot open shared-memory segment " + path + ": " + errnoText(errno));
  struct stat st {};
  const size_t bytes = segmentBytes(worldSize, options.slotBytes);
  if (::fstat(fd, &st) != 0 || static_cast<size_t>(st.st_size) != bytes) {
    ::close(fd);
    throw Error("shared-memory segment " + path + " should have " + std::to_string(bytes) + " bytes for " +
                std::to_string(worldSize) + " ranks, got " + std::to_string(st.st_size));
  }
  void* base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  if (base == MAP_FAILED) {
    int err = errno;
    ::close(fd);
    throw Error("cannot map shared-memory segment " + path + ": " + errnoText(err));
  }
  auto segment = std::make_unique<Segment>(path, fd, base, bytes);
  const Header& h = segment->header();
  if (h.magic != kMagic || h.version != kVersion || h.worldSize != static_cast<uint32_t>(worldSize) ||
      h.slotBytes != options.slotBytes)
    throw Error("shared-memory segment " + path + " is not a dcplan segment of version " +
                std::to_string(kVersion) + " for " + std::to_string(worldSize) + " ranks");
  return std::unique_ptr<ShmComm>(new ShmComm(std::move(segment), rank, worldSize, options));
}

ShmComm::ShmComm(std::unique_ptr<Segment> segment, int rank, int worldSize, const Options& options)
    : segment_(std::move(segment)),
      rank_(rank),
      worldSize_(worldSize),
      options_(options),
      inputs_(worldSize) {
  RankControl& mine = segment_->control(rank_);
  mine.pid = static_cast<int32_t>(::getpid());
  mine.pidNamespace = pidNamespace();
}

ShmComm::~ShmComm() = default;

const std::string& ShmComm::path() const { return segment_->path(); }

void ShmComm::unlinkName() {
  if (::unlink(segment_->path().c_str()) != 0 && errno != ENOENT)
    throw Error("cannot remove shared-memory segment " + segment_->path() + ": " + errnoText(errno));
}

void ShmComm::fail(const std::string& message, bool tellOthers) {
  brokenReason_ = message;
  if (tellOthers) {
    Header& h = segment_->header();
    int32_t none = -1;
    if (h.abortRank.compare_exchange_strong(none, -2)) {
      std::strncpy(h.abortReason, message.c_str(), kReasonBytes - 1);
      h.abortRank.store(rank_, std::memory_order_release);
    }
    for (int r = 0; r < worldSize_; ++r) futex(&segment_->control(r).arrived, FUTEX_WAKE, INT_MAX, nullptr);
  }
  throw Error(message);
}

void ShmComm::sync(const char* op) {
  const uint32_t point = ++syncs_;
  RankControl& mine = segment_->control(rank_);
  mine.arrived.store(point, std::memory_order_seq_cst);
  if (mine.waiters.load(std::memory_order_seq_cst) != 0) futex(&mine.arrived, FUTEX_WAKE, INT_MAX, nullptr);
  waitForAll(op, point);
  // A rank that gave up may have reached this point before it did: its data is not to be trusted.
  checkAbort(op);
}

void ShmComm::checkAbort(const char* op) {
  const Header& h = segment_->header();
  int32_t who = h.abortRank.load(std::memory_order_acquire);
  if (who == -1) return;
  // -2: a rank is writing its reason; it publishes its rank right after.
  for (int i = 0; who == -2 && i < 100'000; ++i) {
    ::sched_yield();
    who = h.abortRank.load(std::memory_order_acquire);
  }
  std::string reason = who >= 0 ? std::string(h.abortReason, strnlen(h.abortReason, kReasonBytes))
                                : std::string("(its reason was not written)");
  fail(std::string(op) + ": rank " + std::to_string(who) + " of the shared-memory group failed: " + reason,
       false);
}

void ShmComm::waitForAll(const char* op, uint32_t point) {
  int next = 0;  // ranks before next have reached the point
  auto allReached = [&] {
    while (next < worldSize_ && reached(segment_->control(next).arrived, point)) ++next;
    return next == worldSize_;
  };
  for (int i = 0; i < kSpins; ++i) {
    if (allReached()) return;
    cpuRelax();
  }
  for (int i = 0; i < kYields; ++i) {
    if (allReached()) return;
    ::sched_yield();
  }

  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  auto lastLiveness = start;
  const uint64_t myPidNs = segment_->control(rank_).pidNamespace;
  while (!allReached()) {
    checkAbort(op);
    const auto now = Clock::now();
    if (now - start > options_.timeout) {
      std::string missing;
      for (int r = next; r < worldSize_; ++r)
        if (!reached(segment_->control(r).arrived, point))
          missing += (missing.empty() ? "" : ", ") + std::to_string(r);
      char waited[32];
      std::snprintf(waited, sizeof waited, "%g", std::chrono::duration<double>(options_.timeout).count());
      fail(std::string(op) + ": rank " + std::to_string(rank_) + " waited " + waited + " s for rank(s) " +
               missing + " at shared-memory synchronisation point " + std::to_string(point) +
               " (timeout: DCPLAN_SHM_TIMEOUT); every rank must call the op with the same sizes, in the same "
               "order",
           true);
    }
    if (now - lastLiveness > kLivenessPeriod) {
      lastLiveness = now;
      for (int r = next; r < worldSize_; ++r) {
        const RankControl& c = segment_->control(r);
        if (reached(c.arrived, point) || c.pidNamespace != myPidNs) continue;
        if (exited(c.pid))
          fail(std::string(op) + ": rank " + std::to_string(r) + " (pid " + std::to_string(c.pid) +
                   ") exited while rank " + std::to_string(rank_) +
                   " waited for it at shared-memory synchronisation point " + std::to_string(point),
               true);
      }
    }
    RankControl& late = segment_->control(next);
    late.waiters.fetch_add(1, std::memory_order_seq_cst);
    const uint32_t seen = late.arrived.load(std::memory_order_seq_cst);
    if (static_cast<int32_t>(seen - point) < 0) {
      const timespec sleep{0, std::chrono::duration_cast<std::chrono::nanoseconds>(kSleep).count()};
      futex(&late.arrived, FUTEX_WAIT, seen, &sleep);
    }
    late.waiters.fetch_sub(1, std::memory_order_seq_cst);
  }
}

void ShmComm::allReduce(const char* op, void* data, size_t count, DType dtype) {
  if (broken())
    throw Error(std::string(op) +
                ": the shared-memory group is unusable after an earlier error: " + brokenReason_);
  const size_t esize = elementSize(dtype);
  const size_t chunkElems = options_.slotBytes / esize;
  char* bytes = static_cast<char*>(data);
  // Zero elements still synchronise once, so that a rank with none is checked against the others.
  size_t offset = 0;
  do {
    const size_t n = std::min(chunkElems, count - offset);
    reduceChunk(op, bytes + offset * esize, n, count, dtype);
    offset += n;
  } while (offset < count);
}

void ShmComm::reduceChunk(const char* op, char* data, size_t count, size_t total, DType dtype) {
  const uint64_t chunk = chunks_++;
  const int buffer = static_cast<int>(chunk & 1);
  const size_t esize = elementSize(dtype);
  SlotHeader& mine = segment_->slotHeader(rank_, buffer);
  mine.chunk = chunk;
  mine.total = total;
  mine.count = count;
  mine.dtype = static_cast<uint32_t>(dtype);
  if (count != 0)
    std::memcpy(segment_->slotData(rank_, buffer), data, count * esize);  // data may be null then
  sync(op);

  std::vector<const void*>& ins = inputs_;
  for (int r = 0; r < worldSize_; ++r) {
    const SlotHeader& theirs = segment_->slotHeader(r, buffer);
    if (theirs.chunk != chunk || theirs.total != total || theirs.count != count ||
        theirs.dtype != mine.dtype) {
      auto describe = [](int rank, const SlotHeader& s) {
        return "rank " + std::to_string(rank) + " reduces " + std::to_string(s.total) + " " +
               dtypeName(static_cast<DType>(s.dtype)) + " elements (chunk " + std::to_string(s.chunk) + ")";
      };
      fail(std::string(op) + ": the ranks disagree: " + describe(rank_, mine) + ", " + describe(r, theirs) +
               "; every rank must call it with the same size and dtype, in the same order",
           false);
    }
    ins[r] = segment_->slotData(r, buffer);
  }

  if (count * esize <= options_.wholeChunkBytes) {
    reduceSum(dtype, data, ins.data(), worldSize_, count);
    return;
  }
  // Rank r sums slice r of every buffer into its own buffer (the only one writing there), then
  // every rank copies every slice out: the same sums, in the same order, as the whole-chunk path.
  const size_t align = 64 / esize;
  const size_t per = roundUp((count + worldSize_ - 1) / worldSize_, align);
  auto sliceBegin = [&](int r) { return std::min(count, r * per); };
  const size_t lo = sliceBegin(rank_), hi = sliceBegin(rank_ + 1);
  if (hi > lo) {
    for (int r = 0; r < worldSize_; ++r) ins[r] = static_cast<const char*>(ins[r]) + lo * esize;
    reduceSum(dtype, segment_->slotData(rank_, buffer) + lo * esize, ins.data(), worldSize_, hi - lo);
  }
  sync(op);
  for (int r = 0; r < worldSize_; ++r) {
    const size_t b = sliceBegin(r), e = sliceBegin(r + 1);
    if (e > b) std::memcpy(data + b * esize, segment_->slotData(r, buffer) + b * esize, (e - b) * esize);
  }
}

}  // namespace dcplan::shm
