// The cross-host schedules and their cost model (schedule/), for Python: the scale model
// (benchmarks/scale_model.py) replays the very steps the engine runs, and the unit tests run
// every schedule on plain numbers. Algorithms are named by their words ("ring", ...).
#include <torch/extension.h>

#include "schedule/cost.h"
#include "schedule/schedule.h"

namespace py = pybind11;

namespace torchring {
namespace {

constexpr Algo kAlgos[] = {Algo::Auto, Algo::Ring,  Algo::Doubling, Algo::Rabenseifner,
                           Algo::Tree, Algo::Bruck, Algo::Radix4, Algo::Multiplying};

Algo algoNamed(const std::string& name) {
  for (Algo a : kAlgos) {
    if (name == algoName(a)) return a;
  }
  throw py::value_error("no cross-host algorithm named '" + name +
                        "'; expected auto, ring, doubling, rabenseifner, radix4, multiplying, tree or bruck");
}

// "rabenseifner:2" -> {Rabenseifner, 2}; any other word -> {that algorithm, 0}.
AllreduceChoice choiceNamed(const std::string& name) {
  const size_t colon = name.find(':');
  if (colon == std::string::npos) return {algoNamed(name), 0};
  const Algo algo = algoNamed(name.substr(0, colon));
  int levels = 0;
  try {
    levels = std::stoi(name.substr(colon + 1));
  } catch (const std::exception&) {
    levels = 0;
  }
  if (algo != Algo::Rabenseifner || levels < 1) {
    throw py::value_error("'" + name + "': only rabenseifner takes a count of halvings (rabenseifner:K, K >= 1)");
  }
  return {algo, levels};
}

py::list ranges(const std::vector<Range>& rs) {
  py::list out;
  for (const Range& r : rs) out.append(py::make_tuple(r.first, r.count));
  return out;
}

// {"algo": "ring", "owned": [(first, count)], "steps": [{"send_to", "recv_from", "send",
// "recv", "fold", "with_next"}]}
py::dict toPython(const Schedule& s) {
  py::list steps;
  for (const Step& step : s.steps) {
    py::dict d;
    d["send_to"] = step.sendTo;
    d["recv_from"] = step.recvFrom;
    d["send"] = ranges(step.send);
    d["recv"] = ranges(step.recv);
    d["fold"] = step.fold;
    d["with_next"] = step.withNext;
    steps.append(d);
  }
  py::dict out;
  out["algo"] = algoName(s.algo);
  out["steps"] = steps;
  out["owned"] = ranges(s.owned);
  return out;
}

void checkMember(int members, int me) {
  if (members < 1 || me < 0 || me >= members) {
    throw py::value_error("member " + std::to_string(me) + " of " + std::to_string(members) +
                          ": expected 0 <= member < members");
  }
}

}  // namespace

void bindSchedules(py::module_& m) {
  py::list names;
  for (Algo a : kAlgos) names.append(algoName(a));
  m.attr("ALGOS") = names;  // index = CommOptions.algo
  m.def(
      "allreduce_schedule",
      [](const std::string& algo, int members, int me, size_t count) {
        checkMember(members, me);
        const AllreduceChoice c = choiceNamed(algo);
        return toPython(allreduceSchedule(c.algo, members, me, count, c.levels));
      },
      py::arg("algo"), py::arg("members"), py::arg("me"), py::arg("count"),
      "member `me`'s steps of an allreduce of `count` elements (units: elements; \"rabenseifner:K\": K halvings)");
  m.def(
      "reduce_scatter_schedule",
      [](int members, int me, const std::vector<std::vector<std::pair<size_t, size_t>>>& blocks) {
        checkMember(members, me);
        if (static_cast<int>(blocks.size()) != members) throw py::value_error("reduce_scatter_schedule: one block per member");
        std::vector<std::vector<Range>> ranges;
        for (const auto& block : blocks) {
          ranges.emplace_back();
          for (const auto& [first, count] : block) ranges.back().push_back({first, count});
        }
        return toPython(reduceScatterSchedule(members, me, ranges));
      },
      py::arg("members"), py::arg("me"), py::arg("blocks"),
      "member `me`'s steps of the ring reduce-scatter into blocks[m] = [(first, count)] (units: elements)");
  m.def(
      "allgather_schedule",
      [](const std::string& algo, int members, int me) {
        checkMember(members, me);
        return toPython(allgatherSchedule(algoNamed(algo), members, me));
      },
      py::arg("algo"), py::arg("members"), py::arg("me"), "member `me`'s steps of an allgather (units: blocks)");
  m.def(
      "broadcast_schedule",
      [](const std::string& algo, int members, int me, int root, size_t bytes, size_t segment) {
        checkMember(members, me);
        checkMember(members, root);
        return toPython(broadcastSchedule(algoNamed(algo), members, me, root, bytes, segment));
      },
      py::arg("algo"), py::arg("members"), py::arg("me"), py::arg("root"), py::arg("bytes"),
      py::arg("segment") = 256 << 10, "member `me`'s steps of a broadcast (units: bytes)");
  m.def(
      "carried_along",
      [](const std::string& algo, int members, int me) {
        checkMember(members, me);
        py::list out;
        for (const Carried& c : carriedAlong(algoNamed(algo), members, me)) out.append(py::make_tuple(c.sent, c.received));
        return out;
      },
      py::arg("algo"), py::arg("members"), py::arg("me"),
      "per step of `me`'s allreduce schedule: (blocks sent, blocks received) when messages carry what their sender knows");
  m.def("partners_of", &partnersOf, py::arg("members"), py::arg("me"),
        "the members `me` keeps a connection to");
  m.def(
      "allreduce_seconds",
      [](const std::string& algo, int members, size_t count, size_t esize, double alpha, double beta, double gamma,
         double alphaGroup) {
        const AllreduceChoice c = choiceNamed(algo);
        return allreduceSeconds(c.algo, members, count, esize, {alpha, beta, gamma, alphaGroup}, c.levels);
      },
      py::arg("algo"), py::arg("members"), py::arg("count"), py::arg("esize"), py::arg("alpha"), py::arg("beta"),
      py::arg("gamma"), py::arg("alpha_group") = 0.0,
      "the cost model's seconds for the slowest member (alpha_group 0: alpha)");
  m.def(
      "schedule_seconds",
      [](const std::string& kind, const std::string& algo, int members, int me, size_t count, size_t unitBytes,
         double alpha, double beta, double gamma, double alphaGroup) {
        checkMember(members, me);
        const AllreduceChoice c = kind == "allreduce" ? choiceNamed(algo) : AllreduceChoice{algoNamed(algo), 0};
        Schedule s = kind == "allreduce" ? allreduceSchedule(c.algo, members, me, count, c.levels)
                                         : allgatherSchedule(c.algo, members, me);
        return scheduleSeconds(s, {unitBytes}, {alpha, beta, gamma, alphaGroup});
      },
      py::arg("kind"), py::arg("algo"), py::arg("members"), py::arg("me"), py::arg("count"), py::arg("unit_bytes"),
      py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("alpha_group") = 0.0,
      "the cost model summed over one member's steps (alpha_group 0: alpha)");
  m.def(
      "choose_allreduce",
      [](const std::string& forced, int members, size_t count, size_t esize, double alpha, double beta,
         double gamma, double alphaGroup, bool staged) {
        return choiceName(chooseAllreduce(choiceNamed(forced), members, count, esize,
                                          {alpha, beta, gamma, alphaGroup}, staged));
      },
      py::arg("forced"), py::arg("members"), py::arg("count"), py::arg("esize"), py::arg("alpha"), py::arg("beta"),
      py::arg("gamma"), py::arg("alpha_group") = 0.0, py::arg("staged") = false,
      "the algorithm the engine runs for this allreduce (\"rabenseifner:K\": K halvings; alpha_group 0: alpha; "
      "staged: every host has several ranks)");
  m.def(
      "rides_on_headers",
      [](const std::string& algo, int members, size_t count, size_t esize, double alpha, double beta,
         double gamma, double alphaGroup, bool staged) {
        return ridesOnHeaders(choiceNamed(algo).algo, members, count, esize, {alpha, beta, gamma, alphaGroup},
                              staged);
      },
      py::arg("algo"), py::arg("members"), py::arg("count"), py::arg("esize"), py::arg("alpha"), py::arg("beta"),
      py::arg("gamma"), py::arg("alpha_group") = 0.0, py::arg("staged") = false,
      "whether this allreduce rides on the header exchange (its first steps carry the headers)");
  m.def(
      "header_algo",
      [](int members, double alpha, double alphaGroup) {
        return std::string(algoName(headerAlgo(members, {alpha, 0, 0, alphaGroup})));
      },
      py::arg("members"), py::arg("alpha"), py::arg("alpha_group") = 0.0,
      "the header exchange's schedule: \"doubling\", or \"multiplying\" where its groups cost less");
  m.def(
      "header_seconds",
      [](int members, double alpha, double alphaGroup) {
        return headerSeconds(members, {alpha, 0, 0, alphaGroup});
      },
      py::arg("members"), py::arg("alpha"), py::arg("alpha_group") = 0.0,
      "the cost model's seconds for the header exchange alone");
  m.def("carried_limit_bytes", [] { return kCarriedLimitBytes; }, "the largest allreduce that may ride on the header exchange");
  m.def(
      "carry_seconds", [](size_t bytes, double alpha, double beta, double gamma, bool staged) {
        return carrySeconds(bytes, {alpha, beta, gamma}, staged);
      },
      py::arg("bytes"), py::arg("alpha"), py::arg("beta"), py::arg("gamma"), py::arg("staged") = false,
      "the copy an allreduce riding on the header exchange makes (none when staged)");
}

}  // namespace torchring
