// The rendezvous of the shared-memory all-reduce over a host transport's ranks.
#include "dcplan/replayer/LocalAllReduce.h"

#include "dcplan/replayer/Runtime.h"
#include "dcplan/shm/ShmComm.h"

#include <ATen/ATen.h>
#include <c10/util/Exception.h>

#include <algorithm>
#include <cstring>
#include <map>

#include <unistd.h>

namespace dcplan::replayer {
namespace {

// What each rank tells the others at one step of the rendezvous: a status and a text.
constexpr int64_t kRecordBytes = 1024;

struct Record {
  bool ok = true;
  std::string text;
};

/// Every rank's record, by rank: one allGather of fixed-size byte rows.
std::vector<Record> exchange(Transport& transport, const Record& mine) {
  const int ws = transport.worldSize();
  at::Tensor in = at::zeros({kRecordBytes}, at::kByte);
  auto* bytes = in.data_ptr<uint8_t>();
  bytes[0] = mine.ok ? 1 : 2;
  std::memcpy(bytes + 1, mine.text.data(), std::min<size_t>(mine.text.size(), kRecordBytes - 2));
  at::Tensor out = at::empty({ws * kRecordBytes}, at::kByte);
  transport.allGather(out, in)->wait();
  std::vector<Record> all(ws);
  const auto* o = out.data_ptr<uint8_t>();
  for (int r = 0; r < ws; ++r) {
    const auto* row = o + r * kRecordBytes;
    all[r].ok = row[0] == 1;
    all[r].text.assign(reinterpret_cast<const char*>(row + 1),
                       strnlen(reinterpret_cast<const char*>(row + 1), kRecordBytes - 1));
  }
  return all;
}

/// Throws on every rank when some rank's record failed, naming each failing rank.
void throwIfAnyFailed(const std::vector<Record>& all, const LocalAllReduceSettings& settings) {
  std::string failures;
  for (size_t r = 0; r < all.size(); ++r)
    if (!all[r].ok)
      failures += (failures.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + all[r].text);
  TORCH_CHECK(
      failures.empty(), "init: the shared-memory all-reduce cannot use ", settings.dir, " (", failures,
      "); give DCPLAN_SHM_DIR a writable tmpfs with room, or set DCPLAN_SHM=off to use the process group");
}

std::string hostName() {
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  return host;
}

}  // namespace

std::string startLocalAllReduce(Transport& transport, const LocalAllReduceSettings& settings) {
  if (!settings.enabled) return "DCPLAN_SHM=off";
  TORCH_CHECK(settings.timeout.count() > 0, "init: the shared-memory timeout should be > 0 ms, got ",
              settings.timeout.count());
  const int rank = transport.rank(), ws = transport.worldSize();
  shm::Options options;
  options.dir = settings.dir;
  options.timeout = settings.timeout;

  // 1. Which shared memory does each rank see? (A missing directory is an error, below.)
  Record where;
  try {
    where.text = shm::localKey(settings.dir) + "\n" + hostName();
  } catch (const shm::Error& e) {
    where = {false, e.what()};
  }
  std::vector<Record> places = exchange(transport, where);
  throwIfAnyFailed(places, settings);
  std::map<std::string, std::vector<int>> byPlace;
  for (int r = 0; r < ws; ++r) byPlace[places[r].text].push_back(r);
  if (byPlace.size() > 1) {
    std::string groups;
    for (const auto& [place, ranks] : byPlace) {
      std::string list;
      for (int r : ranks) list += (list.empty() ? "" : ",") + std::to_string(r);
      groups +=
          (groups.empty() ? "" : "; ") + ("ranks " + list + " on " + place.substr(place.find('\n') + 1));
    }
    return "the ranks do not all share the memory of one machine at " + settings.dir + " (" + groups +
           "): inference_all_reduce uses the process group (" + transport.backendName() + ")";
  }

  // 2. Rank 0 makes the segment and tells its name; 3. the others map it; 4. rank 0 unlinks it.
  Record made;
  std::unique_ptr<shm::ShmComm> comm;
  if (rank == 0) {
    try {
      comm = shm::ShmComm::create(shm::uniqueSegmentName(), ws, options);
      made.text = comm->path().substr(settings.dir.size() + 1);
    } catch (const shm::Error& e) {
      made = {false, e.what()};
    }
  }
  std::vector<Record> names = exchange(transport, made);
  throwIfAnyFailed(names, settings);
  Record opened;
  if (rank != 0) {
    try {
      comm = shm::ShmComm::open(names[0].text, rank, ws, options);
    } catch (const shm::Error& e) {
      opened = {false, e.what()};
    }
  }
  std::vector<Record> joined = exchange(transport, opened);
  Record removed;
  if (rank == 0) {
    try {
      comm->unlinkName();  // whatever happened: every rank that opened it has it mapped
    } catch (const shm::Error& e) {
      removed = {false, e.what()};
    }
  }
  throwIfAnyFailed(joined, settings);
  // Once init returns on any rank, the name is gone from the directory.
  throwIfAnyFailed(exchange(transport, removed), settings);
  setLocalAllReduce(std::move(comm));
  return "";
}

}  // namespace dcplan::replayer
