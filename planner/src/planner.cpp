// The strategies (default, heuristic, optimized), candidate search and --explain text.
#include "dcplan/planner/planner.h"
#include "dcplan/planner/budget_guard.h"
#include "dcplan/planner/offload.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <limits>
#include <stdexcept>

#include "dcplan/planner/in_situ.h"
#include "dcplan/planner/runtime_memory.h"
#include "dcplan/planner/units.h"
#include "dcplan/schemas/dtype.h"
#include "dcplan/schemas/io.h"
#include "dcplan/schemas/network.h"
#include "dcplan/schemas/units.h"
#include "decisions.h"

#ifndef DCPLAN_VERSION
#define DCPLAN_VERSION "0.0.0"
#endif

namespace dcplan::planner {

using namespace detail;
using schemas::formatBytes;
using schemas::formatMs;

const char* strategyName(Strategy s) {
  switch (s) {
    case Strategy::Default:
      return "default";
    case Strategy::Heuristic:
      return "heuristic";
    case Strategy::Optimized:
      return "optimized";
  }
  return "?";
}

std::optional<Strategy> parseStrategy(std::string_view name) {
  if (name == "default") return Strategy::Default;
  if (name == "heuristic") return Strategy::Heuristic;
  if (name == "optimized") return Strategy::Optimized;
  return std::nullopt;
}

Schedule scheduleOf(const schemas::Plan& plan) {
  return Schedule{plan.persistent, plan.graphs, plan.optimizerOffload};
}

namespace {

std::string us(double v) { return formatFixed(v, 1) + " us"; }

/// "1 bucket", "3 buckets".
std::string count(size_t n, const std::string& noun) {
  return std::to_string(n) + " " + noun + (n == 1 ? "" : "s");
}

/// Stages 1 and 2 keep every parameter gathered: persistence is not a choice there.
std::vector<char> stagePersistent(const Workload& w) {
  return std::vector<char>(w.params.size(), w.stage < 3 ? 1 : 0);
}

struct Candidate {
  std::string label;
  std::string name;  ///< label without the prefetch mode, for refinements
  int mode = -1;     ///< index into kModes for planned prefetch, -1 otherwise
  Schedule schedule;
  SimResult sim;
  std::string bucketLabel;
  BucketSet buckets;
  PersistChoice persist;
  std::string persistLabel;
  PrefetchResult prefetch;
  std::string prefetchLabel;
  bool feasible = false;
};

struct BucketOption {
  std::string label;
  BucketSet set;
};

struct Mode {
  FuseMode mode;
  uint64_t cap;
  const char* label;
};
const Mode kModes[] = {{FuseMode::Split, 0, "one call per gather"},
                       {FuseMode::Fuse, 64ull << 20, "fused up to 64.0 MiB"},
                       {FuseMode::Fuse, std::numeric_limits<uint64_t>::max(), "fused, no size cap"}};

/// Predicted step times this close to the fastest count as a tie (see Search::choose).
constexpr double kCallTieShare = 0.01;

/// "GIVEN less 0.5% for allocations the model does not see": how a limit was reduced.
std::string reserveNote(uint64_t given) {
  return formatBytes(given) + " less " + formatFixed(100 * kUnseenReserveShare, 1) +
         "% for allocations the model does not see";
}

class Search {
 public:
  /// limitNote: where the limit comes from, for messages ("--memory-budget 1.00 GiB less 0.5% ...").
  Search(const Workload& w, const CostModel& cost, uint64_t limit, std::string limitNote,
         const ProgressFn& progress)
      : w_(w),
        cost_(cost),
        c_(makeContext(w, cost, limit)),
        limitNote_(std::move(limitNote)),
        progress_(progress) {
    // The default schedule is the recorded run: its collectives are the reference of every
    // other candidate's launch charge (recordedCalls), so it is simulated first (recorded_).
    default_ = evaluate("default", stagePersistent(w_),
                        w_.stage < 3 ? "all (stage " + std::to_string(w_.stage) + ")" : "none",
                        greedyBuckets(c_, kDefaultBucketBytes), "greedy, " + formatBytes(kDefaultBucketBytes),
                        {}, "on use");
    recorded_ = default_.sim;
    haveDefault_ = true;
    // Compared with the other candidates as it will run.
    default_.sim = replayedDefault(w_, cost_, compileSchedule(w_, default_.schedule), recorded_);
    default_.feasible = fits(default_.sim);
  }

  const Context& context() const { return c_; }

  /// Every schedule evaluated from now on keeps this optimizer state on the host (the default
  /// candidate, the recorded run, keeps none).
  void setOffload(std::vector<schemas::OffloadGroup> groups) { c_.offload = std::move(groups); }
  /// ... and these saved activations, by Workload graph index.
  void setOffloadSaves(std::vector<std::vector<schemas::OffloadedSave>> saves) {
    c_.offloadSaves = std::move(saves);
  }

  Candidate evaluate(std::string label, std::vector<char> persistent, std::string persistLabel,
                     BucketSet buckets, std::string bucketLabel, PrefetchResult prefetch,
                     std::string prefetchLabel) {
    Candidate k;
    k.label = std::move(label);
    k.persist.persistent = std::move(persistent);
    for (size_t p = 0; p < w_.params.size(); ++p) {
      if (k.persist.persistent[p]) k.persist.bytes += w_.params[p].gatherBytes;
    }
    k.persistLabel = std::move(persistLabel);
    k.buckets = std::move(buckets);
    k.bucketLabel = std::move(bucketLabel);
    k.prefetch = std::move(prefetch);
    k.prefetchLabel = std::move(prefetchLabel);
    if (k.prefetch.groups.empty()) k.prefetch.groups.resize(w_.graphs.size());
    k.schedule = assemble(c_, k.persist.persistent, k.buckets, k.prefetch.groups);
    simulateCandidate(k);
    return k;
  }

  /// k's schedule simulated against the recorded run (once that is simulated), and whether it fits.
  void simulateCandidate(Candidate& k) const {
    k.sim = simulate(w_, cost_, compileSchedule(w_, k.schedule),
                     haveDefault_ ? againstRecorded(recorded_) : SimOptions{});
    k.feasible = fits(k.sim);
  }

  bool fits(const SimResult& sim) const { return sim.prediction.peakMemoryBytes <= c_.limit; }

  const Candidate& defaultCandidate() const { return default_; }
  /// The simulation of the recorded run: the reference of every candidate's launch charge.
  const SimResult& recordedRun() const { return recorded_; }

  /// The reference design's rules, shrinking its memory shares until the
  /// schedule fits (its own memory check), down to the default schedule.
  Candidate heuristicCandidate(uint64_t defaultPeak) {
    uint64_t headroom = c_.limit > defaultPeak ? c_.limit - defaultPeak : 0;
    BucketSet buckets = greedyBuckets(c_, kDefaultBucketBytes);
    Candidate last;
    for (int attempt = 0; attempt <= 4; ++attempt) {
      double share = attempt == 4 ? 0.0 : 1.0 / static_cast<double>(1 << attempt);
      auto persistCap = static_cast<uint64_t>(share * kReferencePersistShare * static_cast<double>(headroom));
      auto inFlight = static_cast<uint64_t>(share * kReferencePrefetchShare * static_cast<double>(headroom));
      PersistChoice persist =
          w_.stage < 3 ? PersistChoice{stagePersistent(w_), 0, 0} : referencePersistence(c_, persistCap);
      PrefetchResult prefetch = referencePrefetch(c_, persist.persistent, inFlight);
      last = evaluate("heuristic", persist.persistent,
                      w_.stage < 3 ? "all (stage " + std::to_string(w_.stage) + ")"
                                   : "by gather time per byte, up to " + formatBytes(persistCap),
                      buckets, "greedy, " + formatBytes(kDefaultBucketBytes), std::move(prefetch),
                      "groups of " + std::to_string(kReferencePrefetchFactor) + ", one group ahead, up to " +
                          formatBytes(inFlight) + " in flight");
      if (last.feasible) return last;
    }
    return last;
  }

  /// optimizedCandidates beside the default schedule (`def`, defaultCandidate()) and the heuristic one.
  size_t optimized(std::vector<Candidate>& all, const Candidate& def) {
    return optimizedCandidates(all, def, heuristicCandidate(def.sim.prediction.peakMemoryBytes));
  }

  /// Fills `all` with every schedule tried; returns the index of the best.
  size_t optimizedCandidates(std::vector<Candidate>& all, const Candidate& def, const Candidate& heur) {
    // Buckets first: they barely interact with gathers except through memory.
    std::vector<BucketOption> options;
    options.push_back(
        {"greedy, " + formatBytes(kDefaultBucketBytes), greedyBuckets(c_, kDefaultBucketBytes)});
    for (uint64_t cap : {16ull << 20, 64ull << 20, 256ull << 20, 1024ull << 20}) {
      options.push_back({"shortest reduce tail, buckets up to " + formatBytes(cap), optimalBuckets(c_, cap)});
    }
    progress("choosing bucket boundaries");
    std::vector<char> base = stagePersistent(w_);
    int bestBucket = -1;
    Candidate bestOnUse;
    for (size_t k = 0; k < options.size(); ++k) {
      Candidate cand = evaluate("on use, buckets: " + options[k].label, base, w_.stage < 3 ? "all" : "none",
                                options[k].set, options[k].label, {}, "on use");
      if (cand.feasible && (bestBucket < 0 || better(cand, bestOnUse))) {
        bestBucket = static_cast<int>(k);
        bestOnUse = cand;
      }
      all.push_back(std::move(cand));
    }
    if (bestBucket < 0) {
      uint64_t least = std::numeric_limits<uint64_t>::max();
      for (const Candidate& k : all) least = std::min(least, k.sim.prediction.peakMemoryBytes);
      uint64_t act = 0;
      for (const GraphRun& r : w_.runs) act = std::max(act, r.mostActivationBytes());
      throw std::invalid_argument("memory limit " + formatBytes(c_.limit) + " (" + limitNote_ +
                                  ") is below what any schedule needs: at least " + formatBytes(least) +
                                  " with every gather on use (baseline " + formatBytes(w_.baselineBytes) +
                                  ", activations up to " + formatBytes(act) + ")");
    }
    const BucketOption& buckets = options[static_cast<size_t>(bestBucket)];
    uint64_t headroom = c_.limit - bestOnUse.sim.prediction.peakMemoryBytes;

    progress("choosing persistent parameters and prefetch points");
    std::vector<std::vector<char>> seen;
    // Three passes: persistence valued by the gather-stream time it saves; by
    // the stalls the best schedule so far still shows on repeated gathers (plus
    // stream time, which shortens the queue in front of later gathers); by the
    // stalls alone, which keeps memory down when only a few gathers hurt.
    std::vector<double> stalls;
    uint64_t everything = 0;
    for (const WorkParam& p : w_.params) everything += p.gatherBytes;
    for (int pass = 0; pass < 3; ++pass) {
      if (pass == 1) {
        const Candidate* ref = nullptr;
        for (const Candidate& k : all) {
          if (k.feasible && !k.prefetch.decisions.empty() && (!ref || better(k, *ref))) ref = &k;
        }
        if (!ref || w_.stage < 3) break;
        stalls = ref->sim.repeatStallUs;
        if (std::all_of(stalls.begin(), stalls.end(), [](double v) { return v <= 0; })) break;
      }
      // The headroom is over the on-use peak; where something else sets the peak (the
      // optimizer step, when no copy is held), keeping everything may fit as well: the
      // last share (-1) tries it, and the simulation decides.
      for (double fraction : {0.0, 0.25, 0.5, 1.0, -1.0}) {
        if (pass > 0 && (fraction == 0.0 || fraction < 0)) continue;
        PersistChoice persist;
        std::string persistLabel;
        if (w_.stage < 3) {
          if (fraction > 0) break;
          persist.persistent = base;
          persistLabel = "all (stage " + std::to_string(w_.stage) + ")";
        } else {
          auto cap =
              fraction < 0 ? everything : static_cast<uint64_t>(fraction * static_cast<double>(headroom));
          persist = pass == 0 ? knapsackPersistence(c_, cap)
                              : knapsackPersistence(c_, cap, &stalls, 1e-3, /*onlyStalled=*/pass == 2);
          persistLabel = std::string(pass == 0   ? "knapsack of gather time saved"
                                     : pass == 1 ? "knapsack of stalls removed and gather time saved"
                                                 : "knapsack of stalls removed") +
                         (fraction < 0 ? std::string(" per byte, every parameter gathered more than once")
                                       : " per byte, up to " + formatBytes(cap) + " (" +
                                             formatFixed(fraction * 100, 0) + "% of the headroom)");
        }
        if (std::find(seen.begin(), seen.end(), persist.persistent) != seen.end()) continue;
        seen.push_back(persist.persistent);
        addPrefetchCandidates(all, persist, persistLabel,
                              (pass == 0   ? "persist "
                               : pass == 1 ? "persist stalls+time "
                                           : "persist stalls ") +
                                  (fraction < 0 ? std::string("all") : formatFixed(fraction * 100, 0) + "%"),
                              buckets);
      }
    }
    // The buckets were chosen with gathers on use; with the best prefetch and
    // persistence they may no longer be the best: try the others with them.
    int bestPlanned = -1;
    for (size_t k = 0; k < all.size(); ++k) {
      if (all[k].mode >= 0 && all[k].feasible &&
          (bestPlanned < 0 || better(all[k], all[static_cast<size_t>(bestPlanned)]))) {
        bestPlanned = static_cast<int>(k);
      }
    }
    if (bestPlanned >= 0) {
      Candidate ref = all[static_cast<size_t>(bestPlanned)];
      for (size_t k = 0; k < options.size(); ++k) {
        if (static_cast<int>(k) == bestBucket) continue;
        all.push_back(planned(ref.persist, ref.persistLabel, ref.name + ", buckets: " + options[k].label,
                              options[k], ref.mode));
      }
    }
    if (def.feasible) all.push_back(def);
    if (heur.feasible) all.push_back(heur);
    return choose(all);
  }

  /// The fastest feasible candidate; among those predicted within kCallTieShare of it, the
  /// one issuing the fewest collectives (then the least memory). The simulator sees the
  /// device, not the host: where a step is host-bound, each collective costs host time that
  /// only the extra-call penalty (kDefaultLaunchUs) partly models.
  static size_t choose(const std::vector<Candidate>& all) {
    int fastest = -1;
    for (size_t k = 0; k < all.size(); ++k) {
      if (all[k].feasible && (fastest < 0 || better(all[k], all[static_cast<size_t>(fastest)])))
        fastest = static_cast<int>(k);
    }
    const double limit = all[static_cast<size_t>(fastest)].sim.prediction.stepUs * (1 + kCallTieShare) + 1e-3;
    auto calls = [](const Candidate& k) { return k.sim.calls(); };
    size_t best = static_cast<size_t>(fastest);
    for (size_t k = 0; k < all.size(); ++k) {
      const Candidate& c = all[k];
      if (!c.feasible || c.sim.prediction.stepUs > limit) continue;
      const Candidate& b = all[best];
      if (calls(c) < calls(b) ||
          (calls(c) == calls(b) && c.sim.prediction.peakMemoryBytes < b.sim.prediction.peakMemoryBytes)) {
        best = k;
      }
    }
    return best;
  }

  void addPrefetchCandidates(std::vector<Candidate>& all, const PersistChoice& persist,
                             const std::string& persistLabel, const std::string& name,
                             const BucketOption& buckets) {
    for (int m = 0; m < static_cast<int>(std::size(kModes)); ++m) {
      all.push_back(planned(persist, persistLabel, name, buckets, m));
    }
  }

  /// Prefetch planned for a persistent set and buckets, simulated.
  Candidate planned(const PersistChoice& persist, const std::string& persistLabel, const std::string& name,
                    const BucketOption& buckets, int modeIndex) {
    const Mode& m = kModes[modeIndex];
    uint64_t limit = c_.limit;
    Candidate cand;
    // The planning curve times buckets without stalls; when the simulation
    // still passes the budget, plan again against a lower limit.
    for (int attempt = 0; attempt < 4; ++attempt) {
      PrefetchResult prefetch = planPrefetch(c_, persist.persistent, buckets.set, limit, m.mode, m.cap);
      cand = evaluate(name + ", prefetch " + m.label, persist.persistent, persistLabel, buckets.set,
                      buckets.label, std::move(prefetch),
                      std::string("just in time under the limit, ") + m.label);
      if (cand.feasible) break;
      uint64_t over = cand.sim.prediction.peakMemoryBytes - c_.limit;
      if (over + (1u << 20) >= limit) break;
      limit -= over + (1u << 20);
    }
    cand.persist.savedUs = persist.savedUs;
    cand.name = name;
    cand.mode = modeIndex;
    return cand;
  }

  static bool better(const Candidate& a, const Candidate& b) {
    double sa = a.sim.prediction.stepUs, sb = b.sim.prediction.stepUs;
    // Differences below a nanosecond per step are noise of summation order.
    if (sa < sb - 1e-3) return true;
    if (sa > sb + 1e-3) return false;
    return a.sim.prediction.peakMemoryBytes < b.sim.prediction.peakMemoryBytes;
  }

 private:
  void progress(const std::string& what) {
    if (progress_) progress_(what);
  }

  const Workload& w_;
  const CostModel& cost_;
  Context c_;
  std::string limitNote_;
  const ProgressFn& progress_;
  Candidate default_;
  bool haveDefault_ = false;  ///< until default_ is simulated: no launch charge, no agreement checks
  SimResult recorded_;        ///< the default schedule as recorded (default_, less the agreement checks)
};

/// The step the trace is planned for without a memory budget (the device's capacity its only
/// limit), or 0 where no schedule fits that without offload (at once where that limit is no more
/// than `budgeted`, under which the search just failed): what an offload's copy bound holds.
double unconstrainedStepUs(const Workload& w, const CostModel& cost, uint64_t budgeted,
                           const ProgressFn& progress) {
  const uint64_t limit =
      w.capacityBytes > 0 ? plannedLimit(w.capacityBytes) : std::numeric_limits<uint64_t>::max();
  if (limit <= budgeted) return 0.0;
  if (progress) progress("planning without the budget, for the copy bound");
  Search unbudgeted(w, cost, limit, "device capacity, no --memory-budget", progress);
  std::vector<Candidate> all;
  try {
    const size_t best = unbudgeted.optimized(all, unbudgeted.defaultCandidate());
    return all[best].sim.prediction.stepUs;
  } catch (const std::invalid_argument&) {
    return 0.0;
  }
}

/// An offload's copy bound (schemas::Prediction::copyBoundUs): the host link's busier direction,
/// or the step that moves nothing, whichever is longer.
void setCopyBound(schemas::Prediction& p, double unconstrainedUs) {
  p.unconstrainedStepUs = unconstrainedUs;
  p.copyBoundUs = std::max({unconstrainedUs, p.copyInUs, p.copyOutUs});
}

schemas::Prediction rounded(const schemas::Prediction& p) {
  // Three decimals of a microsecond: enough for any decision, and stable text.
  auto r = [](double v) { return std::round(v * 1000.0) / 1000.0; };
  schemas::Prediction out = p;
  for (double* v :
       {&out.stepUs, &out.exposedCommUs, &out.reloadUs, &out.offloadUs, &out.exposedCopyUs,
        &out.activationCopyUs, &out.copyInUs, &out.copyOutUs, &out.unconstrainedStepUs, &out.copyBoundUs})
    *v = r(*v);
  return out;
}

std::string predictionLine(const schemas::Prediction& p) {
  return "step " + us(p.stepUs) + ", exposed comm " + us(p.exposedCommUs) + ", peak " +
         formatBytes(p.peakMemoryBytes);
}

/// The offload the optimized strategy chose, for --explain.
struct OffloadChoice {
  size_t least = 0;    ///< the fewest parameters whose offload lets a schedule fit
  size_t chosen = 0;   ///< offloaded in the plan
  size_t of = 0;       ///< parameters with optimizer state
  uint64_t floor = 0;  ///< the least any schedule needs with the state on the device
  std::vector<std::string> tried;
  size_t masterGroups = 0;  ///< groups whose master shards are offloaded too (ZeRO-3)
  uint64_t stateFloor = 0;  ///< with masters: the least any schedule needs with all state offloaded
  size_t saves = 0;         ///< saved activations offloaded too (ZeRO-3, eager)
  size_t savesOf = 0;       ///< ... of those offloading can move
  uint64_t mastersFloor = 0;  ///< with saves: the least any schedule needs with every master offloaded
};

/// The least peak over `v`'s candidates.
uint64_t leastPeak(const std::vector<Candidate>& v) {
  uint64_t least = std::numeric_limits<uint64_t>::max();
  for (const Candidate& k : v) least = std::min(least, k.sim.prediction.peakMemoryBytes);
  return least;
}

/// The optimized search with `groups` offloaded: fills out/best and returns true where a schedule
/// fits the limit.
bool searchWithOffload(Search& search, std::vector<schemas::OffloadGroup> groups, uint64_t defaultPeak,
                       std::vector<Candidate>& out, size_t& best) {
  search.setOffload(std::move(groups));
  out.clear();
  Candidate heur = search.heuristicCandidate(defaultPeak);
  try {
    best = search.optimizedCandidates(out, search.defaultCandidate(), heur);
    return true;
  } catch (const std::invalid_argument&) {
    return false;
  }
}

/// The least n in (lo, hi] for which attempt(n, out, best) fits, by bisection: attempt(lo) does
/// not fit and attempt(hi) does, with `fits`/`fitsBest` its candidates, which end as the least n's.
template <typename Attempt>
size_t fewestThatFit(size_t lo, size_t hi, Attempt&& attempt, std::vector<Candidate>& fits,
                     size_t& fitsBest) {
  std::vector<Candidate> tried;
  size_t b = 0;
  while (hi - lo > 1) {
    const size_t mid = lo + (hi - lo) / 2;
    if (attempt(mid, tried, b)) {
      hi = mid;
      fits = std::move(tried);
      fitsBest = b;
    } else {
      lo = mid;
    }
  }
  return hi;
}

/// planMasterOffload's last stage, where no schedule fits with all optimizer state and every
/// master shard offloaded (`tried`: those schedules; `below`: the refusal so far): the fewest
/// saved activations (each forward graph's in the order first saved, graph by graph) with which
/// one does are kept on the host from their save until the backward reads them, found by
/// bisection. Throws naming the floor where even all of them are not enough, or where the trace
/// recorded none that can move.
void planActivationOffload(Search& search, const Workload& w, uint64_t defaultPeak, const std::string& below,
                           OffloadChoice& choice, std::vector<Candidate>& tried, size_t& b,
                           const ProgressFn& progress) {
  std::vector<std::pair<int32_t, schemas::OffloadedSave>> order;
  uint64_t total = 0;  // a step's: each save once per run of its graph
  for (size_t g = 0; g < w.graphs.size(); ++g) {
    const auto graph = static_cast<int32_t>(g);
    const auto runs = static_cast<uint64_t>(
        std::count_if(w.runs.begin(), w.runs.end(), [&](const GraphRun& r) { return r.graph == graph; }));
    for (const schemas::OffloadedSave& s : offloadableSaves(w, graph)) {
      order.emplace_back(graph, s);
      total += s.bytes * runs;
    }
  }
  if (order.empty()) {
    throw std::invalid_argument(
        below +
        "; and the trace records no saved activation that can be offloaded: one moves where its forward "
        "graph's "
        "saved_activations entry has freed_at and used_at (a ZeRO-3 eager recording with a warm-up step "
        "records "
        "them: docs/recording.md, \"Saved activations\"), alike in every micro-step of one forward and one "
        "backward");
  }
  auto firstSaves = [&](size_t k) {
    std::vector<std::vector<schemas::OffloadedSave>> out(w.graphs.size());
    for (size_t i = 0; i < k; ++i) out[static_cast<size_t>(order[i].first)].push_back(order[i].second);
    return out;
  };
  auto attempt = [&](size_t k, std::vector<Candidate>& out, size_t& best) {
    if (progress)
      progress("planning with all optimizer state, every master shard and " + std::to_string(k) + " of " +
               std::to_string(order.size()) + " saved activations offloaded");
    search.setOffloadSaves(firstSaves(k));
    return searchWithOffload(search, search.context().offload, defaultPeak, out, best);
  };
  choice.mastersFloor = leastPeak(tried);
  std::vector<Candidate> fits;
  size_t fitsBest = 0;
  if (!attempt(order.size(), fits, fitsBest)) {
    throw std::invalid_argument(below + "; and with every saved activation offloaded too (" +
                                formatBytes(total) + " a step): at least " + formatBytes(leastPeak(fits)));
  }
  // From 0 (none: does not fit) to every one (fits).
  const size_t hi = fewestThatFit(0, order.size(), attempt, fits, fitsBest);
  search.setOffloadSaves(firstSaves(hi));
  choice.saves = hi;
  choice.savesOf = order.size();
  choice.tried.push_back("all with " + std::to_string(hi) +
                         " saved activations: " + us(fits[fitsBest].sim.prediction.stepUs));
  tried = std::move(fits);
  b = fitsBest;
}

/// planOffload's second stage, where no schedule fits with all optimizer state offloaded (`tried`:
/// those schedules): under ZeRO-3 the master shards of the fewest groups (the most master bytes
/// first) with which one does are offloaded too, found by bisection. Fills tried/b with the chosen
/// candidates; throws naming the floor where even that is not enough, or under ZeRO-1/2 (whose
/// gathered copies stay on the device).
void planMasterOffload(Search& search, const Workload& w, const std::string& replay,
                       const std::vector<int32_t>& order, uint64_t defaultPeak, const std::string& limitNote,
                       OffloadChoice& choice, std::vector<Candidate>& tried, size_t& b,
                       const ProgressFn& progress) {
  const std::vector<schemas::OffloadGroup> state = offloadGroups(w, order, order.size());
  choice.stateFloor = leastPeak(tried);
  const std::string below = "memory limit " + formatBytes(search.context().limit) + " (" + limitNote +
                            ") is below what any plan needs with all optimizer state offloaded (" +
                            formatBytes(compileOffload(w, state).bytes) + "): at least " +
                            formatBytes(choice.stateFloor);
  // Where the runtime cannot keep master shards on the host (docs/planning.md, "Offload").
  if (w.stage != 3) throw std::invalid_argument(below + "; master shards are offloaded under ZeRO-3 only");
  if (replay != "eager" || w.cudaGraph) {
    throw std::invalid_argument(below +
                                "; master shards kept on the host are planned for an eager replay only, "
                                "not a compiled one or one CUDA graph per step");
  }
  auto attempt = [&](size_t k, std::vector<Candidate>& out, size_t& best) {
    if (progress)
      progress("planning with all optimizer state and the master shards of " + std::to_string(k) + " of " +
               count(state.size(), "group") + " offloaded");
    return searchWithOffload(search, offloadMasters(w, state, k), defaultPeak, out, best);
  };
  std::vector<Candidate> fits;
  size_t fitsBest = 0;
  if (!attempt(state.size(), fits, fitsBest)) {
    const uint64_t masters = compileOffload(w, offloadMasters(w, state, state.size())).masterBytes;
    planActivationOffload(search, w, defaultPeak,
                          below + "; and with the master shards offloaded too (" + formatBytes(masters) +
                              " more): at least " + formatBytes(leastPeak(fits)),
                          choice, fits, fitsBest, progress);
    choice.least = choice.chosen = order.size();
    choice.masterGroups = state.size();
    tried = std::move(fits);
    b = fitsBest;
    return;
  }
  // From 0 (every master on the device: does not fit) to all of them (fits).
  const size_t hi = fewestThatFit(0, state.size(), attempt, fits, fitsBest);
  search.setOffload(offloadMasters(w, state, hi));
  choice.least = choice.chosen = order.size();
  choice.masterGroups = hi;
  choice.tried.push_back(std::to_string(order.size()) + " with " + std::to_string(hi) +
                         " groups' master shards: " + us(fits[fitsBest].sim.prediction.stepUs));
  tried = std::move(fits);
  b = fitsBest;
}

/// Strategy::Optimized under a limit no schedule meets with the optimizer state on the device:
/// offloads the state of the fewest parameters (the most state first, offloadOrder) with which
/// one does, found by bisection, then tries up to three larger offloads (more headroom for
/// prefetch against more copies) and keeps the fastest. Fills all/best as
/// Search::optimizedCandidates does; below that, planMasterOffload (`replay`: the trace's
/// meta.replay). Throws naming the floor where offloading all of it is not enough, and why no
/// offload can be planned where the trace lacks what it needs.
OffloadChoice planOffload(Search& search, const Workload& w, const CostModel& cost, const std::string& replay,
                          uint64_t defaultPeak, const std::string& noFit, const std::string& limitNote,
                          std::vector<Candidate>& all, size_t& best, const ProgressFn& progress) {
  const std::string why = offloadUnavailable(w, cost);
  if (!why.empty()) throw std::invalid_argument(noFit + "; and no optimizer state can be offloaded: " + why);
  OffloadChoice choice;
  choice.floor = leastPeak(all);
  const std::vector<int32_t> order = offloadOrder(w);
  choice.of = order.size();
  auto attempt = [&](size_t n, std::vector<Candidate>& out, size_t& b) {
    if (progress)
      progress("planning with the optimizer state of " + std::to_string(n) + " of " +
               std::to_string(order.size()) + " parameters offloaded");
    return searchWithOffload(search, offloadGroups(w, order, n), defaultPeak, out, b);
  };
  std::vector<Candidate> tried;
  size_t b = 0;
  if (!attempt(order.size(), tried, b)) {
    planMasterOffload(search, w, replay, order, defaultPeak, limitNote, choice, tried, b, progress);
    all = std::move(tried);
    best = b;
    return choice;
  }
  std::vector<Candidate> fastest = std::move(tried);
  size_t fastestBest = b;
  // From 0 (the search without offload: does not fit) to every parameter's state (fits).
  const size_t hi = fewestThatFit(0, order.size(), attempt, fastest, fastestBest);
  choice.least = choice.chosen = hi;
  auto stepOf = [](const std::vector<Candidate>& v, size_t i) { return v[i].sim.prediction.stepUs; };
  choice.tried.push_back(std::to_string(hi) + ": " + us(stepOf(fastest, fastestBest)));
  const size_t stride = std::max<size_t>(1, (order.size() - hi + 3) / 4);
  for (size_t n = hi + stride; n < order.size() + stride && n - hi <= 3 * stride; n += stride) {
    const size_t m = std::min(n, order.size());
    if (!attempt(m, tried, b)) continue;
    choice.tried.push_back(std::to_string(m) + ": " + us(stepOf(tried, b)));
    if (stepOf(tried, b) < stepOf(fastest, fastestBest) * (1 - kCallTieShare)) {
      fastest = std::move(tried);
      fastestBest = b;
      choice.chosen = m;
    }
    if (m == order.size()) break;
  }
  search.setOffload(offloadGroups(w, order, choice.chosen));
  all = std::move(fastest);
  best = fastestBest;
  return choice;
}

class Explainer {
 public:
  Explainer(const Workload& w, const Context& c, std::vector<std::string>& out) : w_(w), c_(c), out_(out) {}

  void line(std::string s) { out_.push_back(std::move(s)); }

  void buckets(const Candidate& k) {
    line("buckets: " + k.bucketLabel);
    for (size_t g = 0; g < w_.graphs.size(); ++g) {
      const auto& set = k.buckets[g];
      if (set.empty()) continue;
      auto timing = bucketTimings(c_, static_cast<int32_t>(g), set);
      const WorkGraph& wg = w_.graphs[g];
      line("  graph " + std::to_string(wg.id) + " (" + schemas::graphKindName(wg.kind) +
           "): " + count(set.size(), "bucket") + ", last reduction ends " +
           us(timing.back().endUs - timing.back().readyUs) + " after the last gradient is ready");
      for (size_t b = 0; b < set.size(); ++b) {
        line("    bucket " + std::to_string(b) + ": " + count(set[b].dsIds.size(), "grad") + " (ids " +
             idRange(set[b].dsIds) + "), " + formatBytes(set[b].bytes) + ", ready at " +
             us(timing[b].readyUs) + ", reduced " + formatFixed(timing[b].startUs, 1) + "-" +
             formatFixed(timing[b].endUs, 1) + " us");
      }
    }
  }

  void persistence(const Candidate& k, const std::vector<int32_t>& counts) {
    size_t n = 0;
    for (char p : k.persist.persistent) n += p ? 1 : 0;
    line("persistent: " + count(n, "param") + ", " + formatBytes(k.persist.bytes) + ": " + k.persistLabel);
    if (w_.stage < 3) return;
    for (size_t p = 0; p < w_.params.size(); ++p) {
      if (!k.persist.persistent[p]) continue;
      double gather = c_.cost.us(Collective::AllGather, w_.params[p].gatherBytes);
      line("  id " + std::to_string(w_.params[p].id) + " " + w_.params[p].name + ": " +
           formatBytes(w_.params[p].gatherBytes) + ", " + std::to_string(counts[p]) +
           " gathers per step -> 1, saves " + us((counts[p] - 1) * gather));
    }
  }

  void prefetch(const Candidate& k, const std::vector<std::vector<GatherUse>>& uses) {
    line("prefetch: " + k.prefetchLabel);
    for (size_t g = 0; g < w_.graphs.size(); ++g) {
      const WorkGraph& wg = w_.graphs[g];
      const auto& groups = k.prefetch.groups[g];
      if (uses[g].empty()) continue;
      size_t early = 0;
      for (const IssueDecision& d : k.prefetch.decisions) {
        if (d.graph == static_cast<int32_t>(g) && d.group >= 0) ++early;
      }
      line("  graph " + std::to_string(wg.id) + " (" + schemas::graphKindName(wg.kind) +
           "): " + count(uses[g].size(), "gather") + ", " + count(groups.size(), "prefetch group") +
           " holding " + std::to_string(early));
      for (const IssueDecision& d : k.prefetch.decisions) {
        if (d.graph != static_cast<int32_t>(g)) continue;
        const GatherUse& u = uses[g][static_cast<size_t>(d.use)];
        const WorkParam& p = w_.params[static_cast<size_t>(u.param)];
        std::string where = d.group >= 0
                                ? "group @" + std::to_string(groups[static_cast<size_t>(d.group)].position)
                                : "on use";
        line("    id " + std::to_string(p.id) + " " + p.name + ": used at " +
             std::to_string(wg.ops[static_cast<size_t>(u.waitOp)].seq) + ", " + where + ", " +
             std::to_string(u.gatherOp - d.issueOp) + " ops / " + us(d.leadUs) +
             " ahead: " + issueReasonText(d.reason));
      }
    }
  }

 private:
  static std::string idRange(const std::vector<int64_t>& ids) {
    if (ids.size() == 1) return std::to_string(ids[0]);
    return std::to_string(ids.front()) + ".." + std::to_string(ids.back());
  }

  const Workload& w_;
  const Context& c_;
  std::vector<std::string>& out_;
};

/// The in-situ scale of a --calibrate request, or std::invalid_argument saying why the replay
/// cannot calibrate this plan.
InSituFit calibrationFit(const schemas::Trace& trace, const Workload& w, const PlanRequest& req) {
  const ReplayMeasurement& m = *req.calibrate;
  const std::string what = "--calibrate " + m.description + ": ";
  if (w.cudaGraph != m.cudaGraph) {
    throw std::invalid_argument(
        what + (m.cudaGraph ? "the replayed plan ran as one CUDA graph (dcplan.graphed_step), this plan is for "
                              "the host's replay (--no-cuda-graph)"
                            : "the replayed plan ran on the host's replay, this plan is for one CUDA graph "
                              "(--cuda-graph, or a trace of dcplan.graphed_step)") +
        ": a fit to one says nothing of the other; calibrate on a replay of the same kind");
  }
  if (m.worldSize != w.worldSize) {
    throw std::invalid_argument(what + "the replayed plan is for " + std::to_string(m.worldSize) +
                                " ranks, this plan for " + std::to_string(w.worldSize));
  }
  const std::string replayedNetwork = m.network ? "--network " + m.network->file : "the trace's calibration";
  const std::string thisNetwork = req.network ? "--network " + req.network->file : "the trace's calibration";
  if (m.network.has_value() != req.network.has_value() ||
      (m.network && !schemas::sameCollectives(m.network->measured, req.network->measured))) {
    throw std::invalid_argument(what + "the replayed plan was made with " + replayedNetwork +
                                ", this plan with " + thisNetwork +
                                ": a scale fitted to one network's times says nothing of another's");
  }
  InSituFit fit = fitToReplay(trace, w, m.schedule, m.stepUs, req.bandwidthGBps,
                              req.network ? &req.network->measured : nullptr);
  if (!fit.atBound) return fit;
  const std::string range = formatFixed(kInSituMin, 3) + "x and " + formatFixed(kInSituMax, 0);
  const std::string measured = what + "the replay measured " + formatMs(m.stepUs) + " a step where its plan is " +
                               "predicted at " + formatMs(fit.calibratedUs) + " on " + thisNetwork;
  if (w.cudaGraph) {
    throw std::invalid_argument(measured + "; no pace of the device between " + range +
                                "x the plan's times explains that (the communication, or how the graph "
                                "overlaps it, differs from the recording): not calibrated");
  }
  throw std::invalid_argument(measured + "; no collective time between " + range + "x the calibration's " +
                              (w.hostLane ? "and no pace of the host between " + range + "x the recording's "
                                          : "") +
                              "explains that (" +
                              (w.hostLane ? "the device, not the communication or the host,"
                                          : "the host or the device, not the communication,") +
                              " differs from the recording): not calibrated");
}

}  // namespace

CostModelOptions costOptions(const Workload& w, std::optional<double> bandwidthGBps) {
  CostModelOptions o{w.worldSize, bandwidthGBps, measuredLaunchUs(w)};
  // A CUDA graph's replay issues its collectives without the host: no launch cost, and each
  // collective as long as it runs on the device alone.
  if (w.cudaGraph) o.launchUs = 0.0;
  o.deviceQueued = w.cudaGraph;
  o.launchMeasured = o.launchUs.has_value();
  o.agreementChecks = w.checksCollectives;
  return o;
}

Schedule defaultSchedule(const Workload& w) {
  // Costs do not enter the default schedule; a 1-rank model suffices.
  schemas::Calibration none;
  CostModel cost(none, 1, {1, std::nullopt, std::nullopt});
  Context c = makeContext(w, cost, std::numeric_limits<uint64_t>::max());
  return assemble(c, stagePersistent(w), greedyBuckets(c, kDefaultBucketBytes), {});
}

namespace {

/// --explain's first lines: the trace, the cluster, how the step is replayed, the memory limit and
/// the cost model the plan is made with.
void explainSetting(Explainer& ex, const Workload& w, const PlanRequest& req, const std::string& limitText,
                    const std::string& limitNote, const CostModel& cost,
                    const std::optional<InSituFit>& inSitu, double computeScale,
                    const std::optional<CapturedStep>& captured) {
  const size_t runs = w.runs.size();
  ex.line("trace: " + req.traceName + ": " + std::to_string(w.params.size()) + " params, " +
          std::to_string(w.graphs.size()) + " graphs, " + std::to_string(runs) +
          " graph runs per step, step " + std::to_string(w.traceStep));
  ex.line(
      "cluster: " + std::to_string(w.worldSize) + " ranks (traced on " + std::to_string(w.traceWorldSize) +
      "), stage " + std::to_string(w.stage) + ", grad accum " + std::to_string(w.gradAccumSteps) +
      (req.bandwidthGBps ? ", bus bandwidth " + formatFixed(*req.bandwidthGBps, 1) + " GB/s (what-if)" : "") +
      (req.network ? ", collectives as measured on " + std::to_string(req.network->measured.worldSize) +
                         " ranks (--network " + req.network->file + ")"
                   : ""));
  if (computeScale != 1.0) {
    ex.line("compute: the recorded compute and host times x" + formatFixed(computeScale, 2) +
            ", the network's compute probe over the trace's (the ranks there share their hosts' cores "
            "as they will in the job)");
  }
  if (w.cudaGraph) {
    const double ops = w.opDeviceUs();
    ex.line("replay: one CUDA graph per step (" +
            std::string(req.cudaGraph ? "--cuda-graph" : "the trace's step ran in dcplan.graphed_step") +
            "): the device's own compute (device_us), the dc ops' "
            "own work (op_device_us, " +
            (ops > 0 ? formatMs(ops) : std::string("none in this trace")) + ") and optimizer (" +
            formatMs(w.optimizerUs) + "), no host lane, no host cost per collective");
    if (captured) ex.line(capturedStepText(*captured));
  } else if (w.ownDeviceTimes) {
    const double ops = w.opDeviceUs();
    ex.line("device: its own compute (device_us), the dc ops' own work (op_device_us, " +
            (ops > 0 ? formatMs(ops) : std::string("none in this trace")) + ") and optimizer (" +
            formatMs(w.optimizerUs) + "), from the recording's device-lead step; the host lane issues it");
  }
  uint64_t act = 0;
  for (const GraphRun& r : w.runs) act = std::max(act, r.mostActivationBytes());
  ex.line("memory limit: " + limitText + " (" + limitNote + ")" + "; baseline " +
          formatBytes(w.baselineBytes) + ", activations up to " + formatBytes(act));
  ex.line("cost model:");
  for (const std::string& s : cost.describe()) ex.line("  " + s);
  if (inSitu) ex.line("  " + inSituText(*inSitu));
}

/// A --network measurement must be of the trace's transport: another's collectives (NCCL's for a
/// trace of CPU ranks) say nothing about this job's.
void checkNetwork(const schemas::Trace& trace, const schemas::PlanNetwork& network) {
  const schemas::Network& n = network.measured;
  const bool glooTrace = RuntimeMemory::of(trace.meta, 1).transport == RuntimeMemory::Transport::Gloo;
  if ((n.backend == "gloo") != glooTrace) {
    throw std::invalid_argument("--network " + network.file + ": measured on " + n.backend + " (" + n.device +
                                "), the trace on " + (glooTrace ? "gloo" : "nccl") + " (" +
                                trace.meta.device +
                                "): measure the network with the transport the job runs on");
  }
}

}  // namespace

PlanResult makePlan(const schemas::Trace& trace, const PlanRequest& req, const ProgressFn& progress) {
  if (req.worldSize < 0)
    throw std::invalid_argument("--world-size must be positive, got " + std::to_string(req.worldSize));
  if (req.network) checkNetwork(trace, *req.network);
  const schemas::Network* network = req.network ? &req.network->measured : nullptr;
  // A trace whose step ran in dcplan.graphed_step is planned for the graph without being asked.
  const bool cudaGraph = req.cudaGraph.value_or(trace.meta.graphed);
  const int64_t worldSize = req.worldSize > 0 ? req.worldSize : network ? network->worldSize : 0;
  double computeScale = 1.0;
  const StepReplay replay = cudaGraph ? StepReplay::CudaGraph : StepReplay::Issued;
  std::optional<CapturedStep> captured;
  Workload w = plannedWorkload(trace, worldSize, replay, network, &computeScale, &captured);
  if (network && w.worldSize <= 1) {  // one rank's calls are its own copies, which the trace timed
    throw std::invalid_argument("--network " + req.network->file +
                                ": the collectives between ranks; this plan is for 1 rank, which has none "
                                "(its transport's own copies are the trace's to time)");
  }
  if (req.bandwidthGBps && w.worldSize <= 1)  // the cost model has no bus to scale: refused, not ignored
    throw std::invalid_argument(
        "--bandwidth: a bus bandwidth is a what-if for the collectives between ranks; this "
        "plan is for 1 rank, which has none (plan for more with --world-size N)");
  std::optional<InSituFit> inSitu;
  std::optional<double> calibrated;
  std::optional<double> hostScale;
  std::optional<double> deviceScale;
  if (req.calibrate) {
    inSitu = calibrationFit(trace, w, req);
    calibrated = inSitu->collectiveScale;
    if (inSitu->host) hostScale = inSitu->scale;
    if (inSitu->device) deviceScale = inSitu->scale;
    applyReplayFit(w, hostScale, deviceScale);
  }
  CostModel cost =
      plannedCostModel(trace, w, req.bandwidthGBps, network, calibrated, calibrated ? nullptr : &inSitu);
  const uint64_t given = req.memoryBudgetBytes ? *req.memoryBudgetBytes
                         : w.capacityBytes > 0 ? w.capacityBytes
                                               : std::numeric_limits<uint64_t>::max();
  const bool unlimited = given == std::numeric_limits<uint64_t>::max();
  const uint64_t limit = unlimited ? given : plannedLimit(given);
  const std::string limitWhy = req.memoryBudgetBytes ? "--memory-budget"
                               : w.capacityBytes > 0 ? "device capacity"
                                                     : "unlimited";
  const std::string limitNote = unlimited ? limitWhy : limitWhy + " " + reserveNote(given);
  Search search(w, cost, limit, limitNote, progress);
  const Context& c = search.context();
  PlanResult result;
  if (!w.stepChoice.empty()) result.warnings.push_back(w.stepChoice);
  if (captured && captured->atBound) result.warnings.push_back(capturedStepText(*captured));
  if (std::string hostTimed = cost.graphHostTimed(); !hostTimed.empty())
    result.warnings.push_back(std::move(hostTimed));

  Candidate def = search.defaultCandidate();
  Candidate chosen;
  std::optional<OffloadChoice> offload;
  std::vector<Candidate> all;
  size_t best = 0;
  switch (req.strategy) {
    case Strategy::Default:
      chosen = def;
      break;
    case Strategy::Heuristic:
      chosen = search.heuristicCandidate(def.sim.prediction.peakMemoryBytes);
      break;
    case Strategy::Optimized: {
      try {
        best = search.optimized(all, def);
      } catch (const std::invalid_argument& noFit) {
        if (unlimited) throw;
        offload = planOffload(search, w, cost, trace.meta.replay, def.sim.prediction.peakMemoryBytes,
                              noFit.what(), limitNote, all, best, progress);
      }
      chosen = all[best];
      break;
    }
  }
  if (!chosen.feasible) {
    result.warnings.push_back("the " + std::string(strategyName(req.strategy)) +
                              " schedule is predicted to peak at " +
                              formatBytes(chosen.sim.prediction.peakMemoryBytes) +
                              ", over the memory limit of " + formatBytes(limit) + " (" + limitNote + ")");
  }

  schemas::Plan& plan = result.plan;
  plan.createdBy = "dcplan " DCPLAN_VERSION;
  plan.source.trace = req.traceName;
  plan.source.traceDigest = schemas::traceDigest(trace);
  plan.source.paramSignature = schemas::paramSignature(trace.params, w.worldSize);
  plan.source.worldSize = w.worldSize;
  plan.source.stage = w.stage;
  plan.source.replay = trace.meta.replay;
  plan.options.strategy = strategyName(req.strategy);
  plan.options.memoryBudgetBytes = req.memoryBudgetBytes;
  plan.options.bandwidthGBps = req.bandwidthGBps;
  plan.options.gradAccumSteps = w.gradAccumSteps;
  plan.options.cudaGraph = w.cudaGraph;
  plan.options.deviceTimes = w.ownDeviceTimes && !w.cudaGraph;
  // The scale the plan was made with, so that inspect simulates it alike without fitting again.
  // Beside a host scale on CPU ranks always: inspect would otherwise fit the collectives again, on
  // the paced workload (a GPU fits none: docs/planning.md, "In situ").
  if (cost.inSituScale() != 1.0 || (hostScale && w.waitsBlockHost))
    plan.options.inSituScale = cost.inSituScale();
  plan.options.hostScale = hostScale;  // with the collectives' scale it was fitted beside
  plan.options.deviceScale = deviceScale;
  plan.options.network = req.network;
  if (inSitu) result.inSitu = inSituText(*inSitu);
  if (inSitu && inSitu->atBound) result.warnings.push_back(result.inSitu);
  plan.persistent = chosen.schedule.persistent;
  plan.graphs = chosen.schedule.graphs;
  if (req.memoryBudgetBytes) {  // what the runtime's budget guard reads at each prefetch
    const SimResult recorded =
        simulate(w, cost, compileSchedule(w, chosen.schedule), againstRecorded(search.recordedRun(), true));
    setGuardPeaks(w, recorded, plan);
  }
  plan.optimizerOffload = chosen.schedule.optimizerOffload;
  schemas::Prediction predicted = chosen.sim.prediction;
  if (predicted.offloadBytes > 0 || predicted.activationOffloadBytes > 0)
    setCopyBound(predicted, unconstrainedStepUs(w, cost, limit, progress));
  plan.predicted = rounded(predicted);
  plan.predictedDefault = rounded(def.sim.prediction);

  if (req.explain) {
    std::vector<std::string>& out = result.explanation;
    Explainer ex(w, c, out);
    explainSetting(ex, w, req, unlimited ? std::string("none") : formatBytes(limit), limitNote, cost, inSitu,
                   computeScale, captured);
    ex.line("default schedule: " + predictionLine(def.sim.prediction));
    if (req.strategy == Strategy::Optimized) {
      ex.line("strategy optimized: " + std::to_string(all.size()) + " candidate schedules simulated");
      for (size_t i = 0; i < all.size(); ++i) {
        const Candidate& k = all[i];
        ex.line(std::string(i == best ? "  * " : "    ") + k.label + ": " + predictionLine(k.sim.prediction) +
                (k.feasible ? "" : " (over the limit)"));
      }
      ex.line("chosen: " + chosen.label +
              " (fastest within the limit; within 1% of it, fewest collectives, then least memory)");
    } else {
      ex.line("strategy " + std::string(strategyName(req.strategy)) + ": " +
              predictionLine(chosen.sim.prediction));
    }
    if (offload) {
      std::string tried;
      for (const std::string& t : offload->tried) tried += (tried.empty() ? "" : ", ") + t;
      ex.line("offload: no schedule fits with the optimizer state on the device (they need at least " +
              formatBytes(offload->floor) + "); the state of " + std::to_string(offload->chosen) + " of " +
              count(offload->of, "parameter") + " (the most first) is kept " +
              "on the host between steps, in " + count(plan.optimizerOffload.size(), "group") +
              " (at least " + std::to_string(offload->least) + " needed; parameters offloaded: step " +
              tried + ")");
      if (offload->masterGroups > 0) {
        ex.line("offload: no schedule fits with all optimizer state offloaded either (they need at least " +
                formatBytes(offload->stateFloor) + "); the master shards of " +
                std::to_string(offload->masterGroups) + " of " +
                count(plan.optimizerOffload.size(), "group") +
                " (the most first) are kept on the host too, brought back for each gather and their update");
      }
      if (offload->saves > 0) {
        ex.line(
            "offload: no schedule fits with every master shard offloaded either (they need at least " +
            formatBytes(offload->mastersFloor) + "); " + std::to_string(offload->saves) + " of " +
            count(offload->savesOf, "saved activation") +
            " (the first saved first) are kept on the host from their save until the backward reads them");
      }
    }
    ex.buckets(chosen);
    ex.persistence(chosen, gathersPerStep(w));
    ex.prefetch(chosen, gatherUses(c, chosen.persist.persistent));
    ex.line("predicted: " + predictionLine(plan.predicted));
    if (plan.predicted.offloadBytes > 0) {
      const schemas::Prediction& p = plan.predicted;
      ex.line("  offload: " + formatBytes(p.offloadBytes) +
              " of optimizer state and master shards on the host; copies per step in " + us(p.reloadUs) +
              ", out " + us(p.offloadUs) + "; they make the step " + us(p.exposedCopyUs) + " longer");
    }
    if (plan.predicted.activationOffloadBytes > 0) {
      ex.line("  offload: " + formatBytes(plan.predicted.activationOffloadBytes) +
              " of saved activations on the host a step; their copies, " +
              us(plan.predicted.activationCopyUs) + " both ways, run on the compute stream");
    }
    ex.line("  against default: step " + formatChange(plan.predictedDefault.stepUs, plan.predicted.stepUs) +
            ", exposed comm " +
            formatChange(plan.predictedDefault.exposedCommUs, plan.predicted.exposedCommUs) +
            ", peak memory " +
            formatChange(static_cast<double>(plan.predictedDefault.peakMemoryBytes),
                         static_cast<double>(plan.predicted.peakMemoryBytes)));
  }
  return result;
}

int64_t recordedCalls(const Workload& w, const CostModel& cost) {
  return simulate(w, cost, compileSchedule(w, defaultSchedule(w))).calls();
}

}  // namespace dcplan::planner
