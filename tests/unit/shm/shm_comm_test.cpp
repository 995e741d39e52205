// The shared-memory communicator: one thread per rank (a child process where a rank must die).
#include "dcplan/shm/ShmComm.h"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <functional>
#include <random>
#include <thread>
#include <vector>

#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

namespace dcplan::shm {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

/// A fresh directory for segments, removed (with what is left in it) at the end.
class ScratchDir {
 public:
  ScratchDir() {
    std::string tmpl =
        (fs::exists("/dev/shm") ? "/dev/shm" : fs::temp_directory_path().string()) + "/dcplan-test-XXXXXX";
    path_ = ::mkdtemp(tmpl.data());
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  const std::string& path() const { return path_; }
  bool empty() const { return fs::is_empty(path_); }

 private:
  std::string path_;
};

/// Rank 0 creates, the others open, rank 0 unlinks: the rendezvous the runtime does over its process group.
std::vector<std::unique_ptr<ShmComm>> makeGroup(int worldSize, const Options& options) {
  std::vector<std::unique_ptr<ShmComm>> comms;
  const std::string name = uniqueSegmentName();
  comms.push_back(ShmComm::create(name, worldSize, options));
  for (int r = 1; r < worldSize; ++r) comms.push_back(ShmComm::open(name, r, worldSize, options));
  comms[0]->unlinkName();
  return comms;
}

/// Runs fn(rank) on one thread per rank; the errors, by rank ("" for none).
std::vector<std::string> onEveryRank(int worldSize, const std::function<void(int)>& fn) {
  std::vector<std::string> errors(worldSize);
  std::vector<std::thread> threads;
  for (int r = 0; r < worldSize; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (const Error& e) {
        errors[r] = e.what();
      }
    });
  for (auto& t : threads) t.join();
  return errors;
}

Options smallOptions(const std::string& dir) {
  Options o;
  o.dir = dir;
  o.slotBytes = 4096;        // many chunks for small messages
  o.wholeChunkBytes = 1024;  // both algorithms within one message
  o.timeout = std::chrono::seconds(20);
  return o;
}

// Values of rank r, and the expected sum: fp32 accumulated in rank order, rounded once.
float value(int rank, size_t i) {
  return std::ldexp(static_cast<float>((i * 7919 + rank * 104729) % 2001) - 1000.0f, -7);
}

template <typename T>
T fromFloat(float f);
template <>
float fromFloat<float>(float f) {
  return f;
}
template <>
_Float16 fromFloat<_Float16>(float f) {
  return static_cast<_Float16>(f);
}
template <>
uint16_t fromFloat<uint16_t>(float f) {  // bf16, round to nearest even
  uint32_t u = std::bit_cast<uint32_t>(f);
  return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}
template <typename T>
float toFloat(T x);
template <>
float toFloat<float>(float x) {
  return x;
}
template <>
float toFloat<_Float16>(_Float16 x) {
  return static_cast<float>(x);
}
template <>
float toFloat<uint16_t>(uint16_t x) {
  return std::bit_cast<float>(static_cast<uint32_t>(x) << 16);
}

template <typename T>
bool sameBits(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0);
}

template <typename T>
void checkSums(DType dtype, int worldSize, size_t count, const Options& options) {
  auto comms = makeGroup(worldSize, options);
  std::vector<std::vector<T>> data(worldSize, std::vector<T>(count));
  for (int r = 0; r < worldSize; ++r)
    for (size_t i = 0; i < count; ++i) data[r][i] = fromFloat<T>(value(r, i));
  std::vector<T> expected(count);
  for (size_t i = 0; i < count; ++i) {
    float acc = toFloat(data[0][i]);
    for (int r = 1; r < worldSize; ++r) acc += toFloat(data[r][i]);
    expected[i] = fromFloat<T>(acc);
  }
  auto errors = onEveryRank(worldSize, [&](int r) {
    const std::vector<T> input = data[r];
    comms[r]->allReduce("test", data[r].data(), count, dtype);
    std::vector<T> again = input;  // repeated runs give the same bits
    comms[r]->allReduce("test", again.data(), count, dtype);
    if (!sameBits(again, data[r])) throw Error("a repeat differs");
  });
  for (int r = 0; r < worldSize; ++r) ASSERT_EQ(errors[r], "") << "rank " << r;
  for (int r = 0; r < worldSize; ++r)
    ASSERT_TRUE(sameBits(data[r], expected))
        << dtypeName(dtype) << " world " << worldSize << " count " << count << " rank " << r;
}

TEST(ShmComm, SumsEqualTheReferenceBitForBitOnEveryRank) {
  ScratchDir dir;
  const Options options = smallOptions(dir.path());
  // Counts around the vector width, the whole-chunk limit and the chunk size, none a multiple of them.
  for (int worldSize : {1, 2, 3, 4})
    for (size_t count : {size_t{0}, size_t{1}, size_t{17}, size_t{255}, size_t{1023}, size_t{1025},
                         size_t{4097}, size_t{10007}}) {
      checkSums<float>(DType::Float32, worldSize, count, options);
      checkSums<uint16_t>(DType::BFloat16, worldSize, count, options);
      checkSums<_Float16>(DType::Float16, worldSize, count, options);
    }
  EXPECT_TRUE(dir.empty()) << "segments left in " << dir.path();
}

TEST(ShmComm, DefaultChunkSizes) {
  ScratchDir dir;
  Options options;
  options.dir = dir.path();
  checkSums<float>(DType::Float32, 2, (3u << 20) / 4 + 5, options);  // three 1 MiB chunks and a bit
  checkSums<uint16_t>(DType::BFloat16, 3, 1000, options);
}

TEST(ShmComm, RanksThatDisagreeFailTogether) {
  ScratchDir dir;
  for (bool sameDtype : {true, false}) {
    auto comms = makeGroup(2, smallOptions(dir.path()));
    auto errors = onEveryRank(2, [&](int r) {
      std::vector<float> buf(64);
      const DType dtype = sameDtype || r == 0 ? DType::Float32 : DType::BFloat16;
      comms[r]->allReduce("inference_all_reduce_", buf.data(), sameDtype ? 10 + r : 10, dtype);
    });
    for (int r = 0; r < 2; ++r) {
      EXPECT_NE(errors[r].find("inference_all_reduce_: the ranks disagree"), std::string::npos) << errors[r];
      EXPECT_NE(errors[r].find(sameDtype ? "11 float32" : "10 bfloat16"), std::string::npos) << errors[r];
    }
    float x = 1;
    EXPECT_THROW(comms[0]->allReduce("again", &x, 1, DType::Float32), Error);
  }
}

TEST(ShmComm, ARankThatNeverArrivesTimesOutAndTheOthersLeaveToo) {
  ScratchDir dir;
  Options quick = smallOptions(dir.path());
  quick.timeout = std::chrono::seconds(2);
  Options patient = quick;
  patient.timeout = std::chrono::seconds(30);
  const std::string name = uniqueSegmentName();
  auto r0 = ShmComm::create(name, 3, quick);
  auto r1 = ShmComm::open(name, 1, 3, patient);
  auto r2 = ShmComm::open(name, 2, 3, patient);  // never calls
  r0->unlinkName();
  // Rank 0 calls once rank 1 is about to: a thread that a loaded machine started late would be
  // listed as missing beside rank 2. 2 s leaves rank 1's thread time to arrive after setting the
  // flag even when it is preempted there (at 0.3 s that was a window).
  std::atomic<bool> oneCalls{false};
  const auto start = Clock::now();
  auto errors = onEveryRank(2, [&](int r) {
    float x = 1;
    if (r == 1) {
      oneCalls = true;
      r1->allReduce("inference_all_reduce", &x, 1, DType::Float32);
      return;
    }
    while (!oneCalls) std::this_thread::yield();
    r0->allReduce("inference_all_reduce", &x, 1, DType::Float32);
  });
  const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
  EXPECT_NE(errors[0].find("rank 0 waited 2 s for rank(s) 2"), std::string::npos) << errors[0];
  EXPECT_NE(errors[1].find("rank 0 of the shared-memory group failed"), std::string::npos) << errors[1];
  EXPECT_LT(seconds, 10.0) << "rank 1 should leave with rank 0, not at its own 30 s timeout";
  float x = 1;
  try {
    r0->allReduce("later", &x, 1, DType::Float32);
    ADD_FAILURE() << "a broken group should refuse";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("later: the shared-memory group is unusable after an earlier error"),
              std::string::npos);
  }
}

TEST(ShmComm, ADeadRankIsNoticedWithinASecond) {
  ScratchDir dir;
  Options options = smallOptions(dir.path());
  options.timeout = std::chrono::seconds(60);
  const std::string name = uniqueSegmentName();
  auto r0 = ShmComm::create(name, 2, options);
  int ready[2];
  ASSERT_EQ(::pipe(ready), 0);
  pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {  // rank 1: joins, then dies without a word
    auto r1 = ShmComm::open(name, 1, 2, options);
    char c = 1;
    (void)!::write(ready[1], &c, 1);
    ::_exit(0);
  }
  char c = 0;
  ASSERT_EQ(::read(ready[0], &c, 1), 1);
  ::close(ready[0]);
  ::close(ready[1]);
  ::usleep(100'000);  // the child exits and stays a zombie until reaped: that counts as exited too
  r0->unlinkName();
  const auto start = Clock::now();
  float x = 1;
  try {
    r0->allReduce("inference_all_reduce_", &x, 1, DType::Float32);
    ADD_FAILURE() << "the dead rank should be noticed";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("rank 1 (pid " + std::to_string(child) + ") exited"),
              std::string::npos)
        << e.what();
  }
  EXPECT_LT(std::chrono::duration<double>(Clock::now() - start).count(), 2.0);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_TRUE(dir.empty());
}

TEST(ShmComm, AnUnusableDirectoryIsAClearError) {
  ScratchDir dir;
  Options options = smallOptions(dir.path() + "/missing");
  try {
    ShmComm::create(uniqueSegmentName(), 2, options);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(
        std::string(e.what()).find("cannot create shared-memory segment " + dir.path() + "/missing/dcplan-"),
        std::string::npos);
    EXPECT_NE(std::string(e.what()).find("No such file or directory"), std::string::npos) << e.what();
  }
  EXPECT_THROW(localKey(dir.path() + "/missing"), Error);
  EXPECT_NE(localKey(dir.path()), "");
  EXPECT_EQ(localKey(dir.path()), localKey(dir.path() + "/."));
}

/// A tmpfs of its own (needs CAP_SYS_ADMIN: root on CI), unmounted at the end.
class TmpfsMount {
 public:
  explicit TmpfsMount(const std::string& dir, const char* options, unsigned long flags) : dir_(dir) {
    mounted_ = ::mount("tmpfs", dir.c_str(), "tmpfs", flags, options) == 0;
  }
  ~TmpfsMount() {
    if (mounted_) ::umount(dir_.c_str());
  }
  bool mounted() const { return mounted_; }

 private:
  std::string dir_;
  bool mounted_;
};

TEST(ShmComm, AFullTmpfsFailsAtCreateNotWithSIGBUS) {
  ScratchDir dir;
  TmpfsMount tiny(dir.path(), "size=64k", 0);
  if (!tiny.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  Options options = smallOptions(dir.path());
  options.slotBytes = 1 << 20;  // 2 ranks x 2 buffers x 1 MiB > 64 KiB
  try {
    ShmComm::create(uniqueSegmentName(), 2, options);
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("cannot reserve"), std::string::npos) << e.what();
    EXPECT_NE(std::string(e.what()).find("No space left on device"), std::string::npos) << e.what();
  }
  EXPECT_TRUE(fs::is_empty(dir.path())) << "the failed segment should be removed";
}

TEST(ShmComm, AReadOnlyDirectoryFailsAtCreate) {
  ScratchDir dir;
  TmpfsMount readOnly(dir.path(), "size=1m", MS_RDONLY);
  if (!readOnly.mounted()) GTEST_SKIP() << "cannot mount a tmpfs here (needs CAP_SYS_ADMIN)";
  try {
    ShmComm::create(uniqueSegmentName(), 2, smallOptions(dir.path()));
    ADD_FAILURE();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("Read-only file system"), std::string::npos) << e.what();
  }
}

TEST(ShmComm, OpenChecksTheSegment) {
  ScratchDir dir;
  const Options options = smallOptions(dir.path());
  const std::string name = uniqueSegmentName();
  auto r0 = ShmComm::create(name, 2, options);
  EXPECT_THROW(ShmComm::open(name, 1, 3, options), Error);  // made for 2 ranks
  EXPECT_THROW(ShmComm::open(name, 0, 2, options), Error);  // rank 0 creates
  EXPECT_THROW(ShmComm::open("no-such-segment", 1, 2, options), Error);
  EXPECT_THROW(ShmComm::create(name, 2, options), Error);  // names are never reused
  r0->unlinkName();
  EXPECT_TRUE(dir.empty());
}

}  // namespace
}  // namespace dcplan::shm
